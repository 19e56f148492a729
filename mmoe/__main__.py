"""``python -m mmoe``: the ``mmoe`` command (the demo starts its parallel fine-tunings this way)."""

from mmoe.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
