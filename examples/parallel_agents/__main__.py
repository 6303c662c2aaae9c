"""``python -m examples.parallel_agents [--dir DIR]``: both agents, guard off then on."""

from __future__ import annotations

import argparse
from pathlib import Path

from examples.parallel_agents import run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.parallel_agents")
    parser.add_argument("--dir", type=Path, default=None, help="where the SQLite files go "
                        "(default ./.toolguard)")
    args = parser.parse_args(argv)
    for guarded in (False, True):
        outcome = run(guarded, home=args.dir)
        label = "guard on " if guarded else "guard off"
        verdict = "exact" if outcome.balance == outcome.expected else "deposits lost"
        print(f"{label}: balance {outcome.balance}/{outcome.expected} ({verdict})")


if __name__ == "__main__":
    main()
