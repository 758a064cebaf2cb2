"""`python -m exporter.cli`."""

import sys

from exporter.cli import main

if __name__ == "__main__":
    sys.exit(main())
