"""``python -m autockpt``: the same as the ``autockpt`` command (see :mod:`autockpt.tools.cli`)."""

from autockpt.tools.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
