"""`python -m omnifabric.worker`: run one worker."""

import sys

from omnifabric.common import grpc_io

grpc_io.choose()  # before anything imports grpc

from omnifabric.worker.main import main  # noqa: E402

sys.exit(main())
