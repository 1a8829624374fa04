import sys

from splitserve.worker.server import main

sys.exit(main())
