import sys

from edge.main import main

sys.exit(main())
