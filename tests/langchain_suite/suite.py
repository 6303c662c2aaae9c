"""LangChain's own agent test suite, fetched at test time and run with a middleware injected.

``fetch`` downloads the source distribution of the *installed* ``langchain``
with pip (nothing of it is kept in this repository), checks that its
``langchain`` sources are byte for byte the installed ones, and removes them so
its tests import the installed package. ``run`` runs its agent tests
(``tests/unit_tests/agents``: ``create_agent`` and every middleware) once in a
subprocess with ``toolguard_agent_plugin``, as LangChain's ``make test_fast``
runs them (``--disable-socket --allow-unix-socket --benchmark-disable``, its
``blockbuster`` fixture active), and returns the plugin's per-test summary.

``run_all`` runs plain and the control (a no-op tool-call middleware in every
``create_agent``) over the whole suite, two processes at a time, then
toolguard innermost and outermost over the tests the control shows reaching a
middleware: those that build an agent or send a tool call through it. No
other test calls ``create_agent``, so none other can meet toolguard.

By hand: ``python tests/langchain_suite/suite.py [DIR]`` prints the outcome
counts of every run the CI test makes.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __name__ == "__main__":  # run by hand (python tests/<suite>/suite.py): tests/ on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import peer_suite
from peer_suite import SuiteUnavailable

__all__ = ["SuiteUnavailable", "fetch", "run", "run_all"]

PACKAGE = "langchain"
PLUGIN_DIR = Path(__file__).resolve().parent
#: The suite's test directory inside the sdist.
TESTS = "tests/unit_tests/agents"
#: Modules LangChain's agent tests and their conftests import (its ``test`` dependency
#: group), by distribution.
TEST_DEPENDENCIES = {
    "pytest_asyncio": "pytest-asyncio",
    "pytest_mock": "pytest-mock",
    "syrupy": "syrupy",
    "blockbuster": "blockbuster",
    "langchain_tests": "langchain-tests",
    "vcr": "vcrpy",
    "pytest_recording": "pytest-recording",
    "pytest_socket": "pytest-socket",
    "pytest_benchmark": "pytest-benchmark",
    "langchain_openai": "langchain-openai",
}
#: LangChain's ``make test_fast`` options (``-n auto`` aside: one process per run here).
LANGCHAIN_OPTIONS = ("--benchmark-disable", "--disable-socket", "--allow-unix-socket")
#: One run; a loaded machine runs the suite several times slower than an idle one.
RUN_TIMEOUT_S = 1800


@dataclass(frozen=True)
class Variant:
    """One run of the suite: which middleware every ``create_agent`` gets, and where."""

    name: str
    composition: str
    #: Runs only the tests the control run shows reaching a middleware.
    reached_only: bool = False

    def environment(self) -> dict[str, str]:
        return {"TOOLGUARD_SUITE_COMPOSITION": self.composition}


#: The runs the CI test compares. ``passthrough`` is the control: a no-op middleware
#: wrapping tool calls, appended to every ``create_agent``; toolguard must end every
#: test as it does, apart from ``differences.DIFFERENCES``.
VARIANTS = (
    Variant("plain", "plain"),
    Variant("passthrough", "passthrough"),
    Variant("innermost", "innermost", reached_only=True),
    Variant("outermost", "outermost", reached_only=True),
)


@dataclass
class Run:
    """What one run produced: per-test outcomes and the decisions of its guarded calls."""

    variant: Variant
    tests: dict[str, dict[str, Any]]
    returncode: int
    seconds: float
    log: Path

    @property
    def outcomes(self) -> dict[str, str]:
        return {test: entry["outcome"] for test, entry in self.tests.items()}

    def counts(self) -> Counter[str]:
        return Counter(self.outcomes.values())

    def reached(self) -> list[str]:
        """The tests that built an agent or sent a tool call through the middleware."""
        return sorted(test for test, entry in self.tests.items()
                      if entry["agents"] or entry["calls"])

    def differing_from(self, baseline: Run) -> dict[str, tuple[str, str]]:
        """``test -> (baseline outcome, this outcome)`` for every test both ran that ended otherwise."""
        mine, theirs = self.outcomes, baseline.outcomes
        return {test: (theirs[test], mine[test]) for test in sorted(set(mine) & set(theirs))
                if mine[test] != theirs[test]}


def missing_dependencies() -> list[str]:
    return peer_suite.missing_dependencies(TEST_DEPENDENCIES)


def installed_version() -> str:
    return peer_suite.installed_version(PACKAGE)


def fetch(folder: Path) -> Path:
    """Download and unpack the installed version's sdist; return the unpacked root."""
    import langchain

    return peer_suite.fetch_sdist(folder, PACKAGE, installed=Path(langchain.__file__).parent,
                                  shipped="langchain", timeout_s=RUN_TIMEOUT_S)


def run(root: Path, variant: Variant, out: Path, tests: list[str] | None = None) -> Run:
    """Run the agent tests (or only ``tests``) once, unmodified, configured for ``variant``."""
    environment = variant.environment()
    if tests:
        out.mkdir(parents=True, exist_ok=True)
        only = out / "only.txt"
        only.write_text("".join(f"{test}\n" for test in tests))
        environment["TOOLGUARD_SUITE_ONLY"] = str(only)
    done = peer_suite.run_suite(root, out, variant.name, plugin_dir=PLUGIN_DIR,
                                environment=environment,
                                arguments=[TESTS, *LANGCHAIN_OPTIONS, "-p", "toolguard_agent_plugin"],
                                timeout_s=RUN_TIMEOUT_S)
    return Run(variant, done.tests, done.returncode, done.seconds, done.log)


@dataclass
class Results:
    """Every run of one fetched suite."""

    root: Path
    folder: Path
    runs: dict[str, Run]
    fetch_seconds: float

    def flaky(self, variant: str, baseline: str, tests: set[str]) -> set[str]:
        """Those of ``tests`` (differing between ``baseline`` and ``variant``) that end alike
        when both re-run them alone.

        LangChain's suite has timed checks (a retry's backoff must take less than 0.5 s); on
        a loaded machine they fail now and then, in any run. A difference the middleware
        causes shows up again in a re-run, a race of the moment does not. The caller
        reports every flaky test it forgives.
        """
        if not tests:
            return set()
        chosen = sorted(tests)
        folder = self.folder / "reruns" / f"{variant}-{baseline}"
        with ThreadPoolExecutor(max_workers=2) as pool:
            again, base = pool.map(
                lambda name: run(self.root, self.runs[name].variant, folder / name, chosen),
                (variant, baseline))
        return {test for test in chosen
                if test in again.tests and again.outcomes[test] == base.outcomes.get(test)}


def run_all(folder: Path, variants: tuple[Variant, ...] = VARIANTS) -> Results:
    """Fetch once; run the full variants, then the others over the tests the control reached."""
    started = time.monotonic()
    root = fetch(folder)
    fetched = time.monotonic() - started
    runs: dict[str, Run] = {}

    def one(variant: Variant, tests: list[str] | None = None) -> Run:
        return run(root, variant, folder / "runs" / variant.name, tests)

    with ThreadPoolExecutor(max_workers=2) as pool:
        full = [v for v in variants if not v.reached_only]
        for variant, result in zip(full, pool.map(one, full), strict=True):
            runs[variant.name] = result
        reached = runs["passthrough"].reached()
        narrow = [v for v in variants if v.reached_only]
        for variant, result in zip(narrow, pool.map(lambda v: one(v, reached), narrow),
                                   strict=True):
            runs[variant.name] = result
    return Results(root, folder, runs, fetched)


def main(argv: list[str]) -> int:
    import tempfile

    folder = Path(argv[1]) if len(argv) > 1 else Path(tempfile.mkdtemp(prefix="lc-suite-"))
    results = run_all(folder)
    control = results.runs["passthrough"]
    print(f"{PACKAGE} {installed_version()}: fetched in {results.fetch_seconds:.1f}s, in {folder}")
    for name, result in results.runs.items():
        counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts().items()))
        calls = sum(entry["calls"] for entry in result.tests.values())
        print(f"{name:12} {counts:40} {len(result.differing_from(control)):3} differ from "
              f"passthrough, {calls:4} middleware calls  ({result.seconds:.1f}s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
