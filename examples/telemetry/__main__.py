"""``python -m examples.telemetry [--dir DIR] [--console]``: the demo's spans and metrics."""

from examples.telemetry import main

if __name__ == "__main__":
    raise SystemExit(main())
