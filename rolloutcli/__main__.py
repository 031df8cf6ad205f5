"""``python -m rolloutcli``."""

import sys

from rolloutcli.cli import main

sys.exit(main())
