"""``python -m logitdiff.cli``: the same as the ``logitdiff`` command."""

import sys

from . import entry

sys.exit(entry())
