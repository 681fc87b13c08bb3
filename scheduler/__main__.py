"""`python -m omnifabric.scheduler`."""

import sys

from omnifabric.common import grpc_io

grpc_io.choose()  # before anything imports grpc

from omnifabric.scheduler.main import main  # noqa: E402

sys.exit(main())
