"""``python -m holders``: the holder agent a provider runs (see ``holders.cli``)."""
import sys

from holders.cli import main

sys.exit(main())
