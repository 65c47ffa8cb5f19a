"""``python -m tensorwire``: the ``tensorwire`` command (``tensorwire.cli.main``)."""

import sys

from tensorwire.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
