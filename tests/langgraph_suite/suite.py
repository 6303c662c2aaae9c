"""LangGraph's own prebuilt test suite, fetched at test time and run with toolguard injected.

``fetch`` downloads the source distribution of the *installed*
``langgraph-prebuilt`` with pip (nothing of it is kept in this repository),
checks that its ``langgraph/prebuilt`` sources are byte for byte the installed
ones, and removes them so its tests import the installed package. ``run`` runs
its ``tests/`` once in a subprocess with ``toolguard_suite_plugin`` and returns
the plugin's per-test summary.

By hand: ``python tests/langgraph_suite/suite.py [DIR]`` prints the outcome
counts of every run the CI test makes.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by hand (python tests/<suite>/suite.py): tests/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import peer_suite
from peer_suite import SuiteUnavailable

__all__ = ["SuiteUnavailable", "fetch", "run", "run_all"]

PACKAGE = "langgraph-prebuilt"
PLUGIN_DIR = Path(__file__).resolve().parent
#: Modules the prebuilt suite imports (its ``test`` dependency group), by distribution.
TEST_DEPENDENCIES = {
    "pytest_asyncio": "pytest-asyncio",
    "pytest_mock": "pytest-mock",
    "syrupy": "syrupy",
    "langgraph.checkpoint.sqlite": "langgraph-checkpoint-sqlite",
    "langgraph.checkpoint.postgres": "langgraph-checkpoint-postgres",
}
RUN_TIMEOUT_S = 600


@dataclass(frozen=True)
class Variant:
    """One run of the suite: where toolguard sits and how it is configured."""

    name: str
    composition: str
    on_unknown_tool: str = "deny"
    metadata: bool = True

    def environment(self) -> dict[str, str]:
        return {"TOOLGUARD_SUITE_COMPOSITION": self.composition,
                "TOOLGUARD_SUITE_UNKNOWN": self.on_unknown_tool,
                "TOOLGUARD_SUITE_METADATA": "1" if self.metadata else "0"}


#: The runs the CI test compares. ``bare-*`` turns off the two deliberate differences
#: toolguard's defaults make (response metadata, denied unknown tools): what is left
#: must be exactly what any wrapper changes (``passthrough``).
VARIANTS = (
    Variant("plain", "plain"),
    Variant("passthrough", "passthrough"),
    Variant("outermost", "outermost"),
    Variant("innermost", "innermost"),
    Variant("bare-outermost", "outermost", on_unknown_tool="allow", metadata=False),
    Variant("bare-innermost", "innermost", on_unknown_tool="allow", metadata=False),
)


@dataclass
class Run:
    """What one run produced: per-test outcomes and the decisions of its guarded calls."""

    variant: Variant
    tests: dict[str, dict[str, Any]]
    returncode: int
    seconds: float
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def outcomes(self) -> dict[str, str]:
        return {test: entry["outcome"] for test, entry in self.tests.items()}

    def counts(self) -> Counter[str]:
        return Counter(self.outcomes.values())

    def differing_from(self, baseline: Run) -> dict[str, tuple[str, str]]:
        """``test -> (baseline outcome, this outcome)`` for every test whose outcome changed."""
        mine, theirs = self.outcomes, baseline.outcomes
        return {test: (theirs.get(test, "missing"), mine.get(test, "missing"))
                for test in sorted(set(mine) | set(theirs))
                if mine.get(test) != theirs.get(test)}


def missing_dependencies() -> list[str]:
    return peer_suite.missing_dependencies(TEST_DEPENDENCIES)


def installed_version() -> str:
    return peer_suite.installed_version(PACKAGE)


def fetch(folder: Path) -> Path:
    """Download and unpack the installed version's sdist; return the unpacked root."""
    import langgraph.prebuilt

    return peer_suite.fetch_sdist(folder, PACKAGE,
                                  installed=Path(langgraph.prebuilt.__file__).parent,
                                  shipped="langgraph/prebuilt", timeout_s=RUN_TIMEOUT_S)


def run(root: Path, variant: Variant, out: Path, tests: list[str] | None = None) -> Run:
    """Run the suite's ``tests/`` (or only ``tests``) once, unmodified, configured for ``variant``."""
    done = peer_suite.run_suite(root, out, variant.name, plugin_dir=PLUGIN_DIR,
                                environment=variant.environment(),
                                arguments=[*(tests or ["tests"]), "-p", "toolguard_suite_plugin"],
                                timeout_s=RUN_TIMEOUT_S)
    return Run(variant, done.tests, done.returncode, done.seconds, done.log)


@dataclass
class Results:
    """Every run of one fetched suite."""

    root: Path
    folder: Path
    runs: dict[str, Run]
    fetch_seconds: float

    def flaky(self, variant: str, tests: set[str]) -> set[str]:
        """Those of ``tests`` (differing between plain and ``variant``) that end alike re-run alone.

        LangGraph's suite has timing-dependent checks (its checkpointer asserts no
        concurrent write changed a saved checkpoint); a difference toolguard
        causes shows up again in a re-run, a race of the moment does not. The
        caller reports every flaky test it forgives.
        """
        if not tests:
            return set()
        chosen = sorted(tests)
        with ThreadPoolExecutor(max_workers=2) as pool:
            again, plain = pool.map(
                lambda name: run(self.root, self.runs[name].variant,
                                 self.folder / "reruns" / f"{name}-{variant}", chosen),
                (variant, "plain"))
        return {test for test in chosen if test in again.tests and
                again.outcomes[test] == plain.outcomes.get(test)}


def run_all(folder: Path, variants: tuple[Variant, ...] = VARIANTS) -> Results:
    """Fetch once and run every variant."""
    started = time.monotonic()
    root = fetch(folder)
    fetched = time.monotonic() - started
    with ThreadPoolExecutor(max_workers=2) as pool:  # two subprocesses at a time
        done = pool.map(lambda v: run(root, v, folder / "runs" / v.name), variants)
        runs = {v.name: result for v, result in zip(variants, done, strict=True)}
    return Results(root, folder, runs, fetched)


def main(argv: list[str]) -> int:
    import tempfile

    folder = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="lg-suite-"))
    results = run_all(folder)
    plain = results.runs["plain"]
    print(f"{PACKAGE} {installed_version()}: fetched in {results.fetch_seconds:.1f}s, in {folder}")
    for name, result in results.runs.items():
        counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts().items()))
        print(f"{name:16} {counts:40} {len(result.differing_from(plain)):3} differ from plain"
              f"  ({result.seconds:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
