"""``python -m mmoe``: the ``mmoe`` command (the same as the ``mmoe`` entry point)."""

from mmoe.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
