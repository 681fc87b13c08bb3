"""`python -m worker`: run one worker."""

import sys

from worker.main import main

sys.exit(main())
