"""``python -m logitdiff.cli``: the same as the ``logitdiff`` command."""

import sys

from . import main

sys.exit(main())
