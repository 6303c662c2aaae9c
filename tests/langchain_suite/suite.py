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

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


class SuiteUnavailable(Exception):
    """The suite could not be fetched or its test dependencies are missing."""


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
    return [distribution for module, distribution in TEST_DEPENDENCIES.items()
            if importlib.util.find_spec(module) is None]


def installed_version() -> str:
    return importlib.metadata.version(PACKAGE)


def fetch(folder: Path) -> Path:
    """Download and unpack the installed version's sdist; return the unpacked root."""
    version = installed_version()
    download = folder / "download"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "--dest", str(download),
               f"{PACKAGE}=={version}"]
    if importlib.util.find_spec("hatchling") is not None:
        # pip prepares the sdist's metadata with its build backend (hatchling); installed,
        # it need not fetch one into an isolated build environment first.
        command.append("--no-build-isolation")
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    archives = sorted(download.glob("*.tar.gz"))
    if done.returncode != 0 or not archives:
        raise SuiteUnavailable(f"pip download {PACKAGE}=={version} failed: "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
    with tarfile.open(archives[0]) as archive:
        archive.extractall(folder / "src", filter="data")
    (root,) = (folder / "src").iterdir()
    _check_same_sources(root)
    shutil.rmtree(root / "langchain")  # the tests must import the installed package
    return root


def _check_same_sources(root: Path) -> None:
    """The sdist's ``langchain`` package must be the installed one, byte for byte."""
    import langchain

    installed = Path(langchain.__file__).parent
    shipped = root / "langchain"
    names = {p.relative_to(shipped) for p in shipped.rglob("*.py")}
    if names != {p.relative_to(installed) for p in installed.rglob("*.py")}:
        raise SuiteUnavailable(f"{shipped} and {installed} hold different files")
    changed = [str(name) for name in sorted(names)
               if (shipped / name).read_bytes() != (installed / name).read_bytes()]
    if changed:
        raise SuiteUnavailable(f"the sdist's sources differ from the installed ones: {changed}")


def run(root: Path, variant: Variant, out: Path, tests: list[str] | None = None) -> Run:
    """Run the agent tests (or only ``tests``) once, unmodified, configured for ``variant``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTEST_", "TOOLGUARD_SUITE_"))}
    env.update(variant.environment())
    env.update({
        "TOOLGUARD_SUITE_DIR": str(out),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN_DIR), env.get("PYTHONPATH")])),
        # The suite's own default: in-memory checkpointers and stores only (its PostgreSQL
        # and SQLite parametrizations need the servers of its docker compose files).
        "LANGGRAPH_TEST_FAST": "true",
    })
    if tests:
        only = out / "only.txt"
        only.write_text("".join(f"{test}\n" for test in tests))
        env["TOOLGUARD_SUITE_ONLY"] = str(only)
    log = out / "pytest.log"
    command = [sys.executable, "-m", "pytest", TESTS, *LANGCHAIN_OPTIONS,
               "-p", "toolguard_agent_plugin", "-p", "no:cacheprovider", "-q"]
    started = time.monotonic()
    with log.open("w") as sink:
        done = subprocess.run(command, cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT_S)
    seconds = time.monotonic() - started
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise SuiteUnavailable(f"{variant.name}: no summary (exit {done.returncode}); see {log}")
    summary = json.loads(summary_path.read_text())["tests"]
    return Run(variant, summary, done.returncode, seconds, log)


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
