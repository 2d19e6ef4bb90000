"""``python -m flax_ckpt ...``: the flax-ckpt command."""

import sys

from flax_ckpt._src.tools.cli import main

sys.exit(main())
