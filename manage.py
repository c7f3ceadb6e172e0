#!/usr/bin/env python
"""Django's command-line utility for the Tenzro distributed MoE site."""
import os
import sys


def main():
    """Run a management command with ``tenzro_site.settings`` as the default settings."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tenzro_site.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)


if __name__ == "__main__":
    main()
