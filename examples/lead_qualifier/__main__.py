"""``python -m examples.lead_qualifier [--dir DIR] [--json]``: the demo with this folder's policy."""

from __future__ import annotations

import sys

from examples.lead_qualifier import POLICY_PATH
from toolguard.cli import app


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    app(["demo", "--policy", str(POLICY_PATH), *args], prog_name="python -m examples.lead_qualifier")


if __name__ == "__main__":
    main()
