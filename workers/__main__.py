"""``python -m lmqueue.workers``: run one worker process."""

import sys

from .main import main

sys.exit(main())
