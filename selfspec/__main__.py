"""``python -m selfspec``: the same command line as the ``selfspec`` script."""

import sys

from .cli import main

sys.exit(main())
