import sys

from omnifabric.edge.main import main

sys.exit(main())
