"""``python -m lmqueue.scheduler``: one scheduler process."""

import sys

from .main import main

sys.exit(main())
