"""``python -m flax_ckpt ...``: the flax-ckpt command."""

import sys

from flax_ckpt._src.cli import main

sys.exit(main())
