"""``python manage.py holder_agent ...``: a thin alias of ``python -m holders ...`` (the standalone agent).

The agent needs no Django: this command only replaces itself with that program, passing the site's
``TENZRO_VAR_DIR`` so the default key and blob directory stay where they were.
"""
from __future__ import annotations

import os
import sys

from django.conf import settings
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Run a holder agent (alias of `python -m holders`; `python -m holders --help` lists the flags)."

    def run_from_argv(self, argv):
        """Exec ``python -m holders`` with every argument after the command name."""
        env = dict(os.environ)
        env.setdefault("TENZRO_VAR_DIR", str(settings.VAR_DIR))
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "holders", *argv[2:]], env)
