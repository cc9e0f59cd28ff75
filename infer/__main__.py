"""``python -m infer``: the same as the ``infer`` command."""

import sys

from .cli import main

sys.exit(main())
