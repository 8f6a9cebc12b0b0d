"""``python -m fxamp ...``: the same as the ``fxamp`` command."""

from .cli import main

if __name__ == "__main__":
    raise SystemExit(main())
