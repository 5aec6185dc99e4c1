"""``python -m lmqueue``: the `lmq` command line."""

import sys

from .cli import main

sys.exit(main())
