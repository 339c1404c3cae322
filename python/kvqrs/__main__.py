"""``python -m kvqrs``: the same as the ``kvqrs`` command."""

import sys

from .cli import main

sys.exit(main())
