"""``python -m gateway``: the supervisor and its worker processes (``gateway.workers``)."""

import sys

from gateway.workers import main

if __name__ == "__main__":
    sys.exit(main())
