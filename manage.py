#!/usr/bin/env python
import os
import sys

if __name__ == "__main__":
    # Every file and directory a management command creates (the database and its journals, the
    # static files, the grant file, tokens) is its user's alone, whatever umask it was started
    # with; `serve` (the gateway) inherits it (README, "What runs").
    os.umask(0o077)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "aotx_site.settings")
    from django.core.management import execute_from_command_line
    execute_from_command_line(sys.argv)
