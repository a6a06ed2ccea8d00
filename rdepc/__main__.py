"""``python -m rdepc``: the command line, e.g. ``torchrun --nproc-per-node W -m rdepc run ...``."""

import sys

from rdepc.cli import main

if __name__ == "__main__":
    sys.exit(main())
