"""``python -m lmqueue.bench <name>``: the same as ``lmq bench <name>``."""

import sys

from .dispatch import main

sys.exit(main())
