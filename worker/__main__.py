"""`python -m omnifabric.worker`: run one worker."""

import sys

from omnifabric.worker.main import main

sys.exit(main())
