"""``python -m lazarus_cli ...``: the `lazarus` command with whichever Python runs it, e.g.
the one that has torch installed system-wide on a GPU machine (no venv, no install)."""
import sys

from .main import main

sys.exit(main())
