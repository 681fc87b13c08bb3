"""`python -m omnifabric.scheduler`."""

import sys

from omnifabric.scheduler.main import main

sys.exit(main())
