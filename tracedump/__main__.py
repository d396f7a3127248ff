"""``python -m tracedump`` is the ``tracedump`` command."""

import sys

from .cli import main

sys.exit(main())
