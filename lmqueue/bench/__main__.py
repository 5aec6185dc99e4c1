"""``python -m lmqueue.bench <command>``: the same as ``lmq bench <command>``."""

import sys

from .commands import main

sys.exit(main())
