"""``python -m autockpt``: the same as the ``autockpt`` command (see :mod:`autockpt.cli`)."""

from autockpt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
