"""Entry point of ``python -m pcaf_core.data`` (see :mod:`pcaf_core.data.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
