"""``python -m holders``: the holder agent a provider runs (see ``holders.agent.cli``)."""
import sys

from holders.agent.cli import main

sys.exit(main())
