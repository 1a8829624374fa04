import sys

from splitserve.runtime.grpc_fork import disable_grpc_fork_handlers

disable_grpc_fork_handlers()  # before the server imports gRPC

from splitserve.workers.server import main  # noqa: E402

sys.exit(main())
