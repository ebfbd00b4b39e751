"""``python -m celery_lease.demo``."""

import sys

from . import main

sys.exit(main())
