import sys

from splitserve.grpc_fork import disable_grpc_fork_handlers

disable_grpc_fork_handlers()  # before the server imports gRPC

from splitserve.worker.server import main  # noqa: E402

sys.exit(main())
