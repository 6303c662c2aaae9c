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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


class SuiteUnavailable(Exception):
    """The suite could not be fetched or its test dependencies are missing."""


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
    missing = []
    for module, distribution in TEST_DEPENDENCIES.items():
        try:
            __import__(module)
        except ImportError:
            missing.append(distribution)
    return missing


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
        # pip prepares the sdist's metadata with its build backend; with hatchling
        # installed it need not fetch one into an isolated build environment first.
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
    shutil.rmtree(root / "langgraph")  # the tests must import the installed package
    return root


def _check_same_sources(root: Path) -> None:
    """The sdist's ``langgraph/prebuilt`` must be the installed one, byte for byte."""
    import langgraph.prebuilt

    installed = Path(langgraph.prebuilt.__file__).parent
    shipped = root / "langgraph" / "prebuilt"
    names = {p.relative_to(shipped) for p in shipped.rglob("*.py")}
    if names != {p.relative_to(installed) for p in installed.rglob("*.py")}:
        raise SuiteUnavailable(f"{shipped} and {installed} hold different files")
    changed = [str(name) for name in sorted(names)
               if (shipped / name).read_bytes() != (installed / name).read_bytes()]
    if changed:
        raise SuiteUnavailable(f"the sdist's sources differ from the installed ones: {changed}")


def run(root: Path, variant: Variant, out: Path, tests: list[str] | None = None) -> Run:
    """Run the suite's ``tests/`` (or only ``tests``) once, unmodified, configured for ``variant``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTEST_", "TOOLGUARD_SUITE_"))}
    env.update(variant.environment())
    env.update({
        "TOOLGUARD_SUITE_DIR": str(out),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PLUGIN_DIR), env.get("PYTHONPATH")])),
        # The suite's own default: in-memory checkpointers and stores only. Its PostgreSQL
        # parametrizations create databases on a server of their own (port 5442) and
        # are not generated in this mode.
        "LANGGRAPH_TEST_FAST": "true",
    })
    log = out / "pytest.log"
    command = [sys.executable, "-m", "pytest", *(tests or ["tests"]), "-p", "toolguard_suite_plugin",
               "-p", "no:cacheprovider", "-q"]
    started = time.monotonic()
    with log.open("w") as sink:
        done = subprocess.run(command, cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT,
                              timeout=RUN_TIMEOUT_S)
    seconds = time.monotonic() - started
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise SuiteUnavailable(f"{variant.name}: no summary (exit {done.returncode}); see {log}")
    tests = json.loads(summary_path.read_text())["tests"]
    return Run(variant, tests, done.returncode, seconds, log)


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
        again = run(self.root, self.runs[variant].variant, self.folder / "reruns" / variant, chosen)
        plain = run(self.root, self.runs["plain"].variant, self.folder / "reruns" / f"plain-{variant}",
                    chosen)
        return {test for test in chosen if test in again.tests and
                again.outcomes[test] == plain.outcomes.get(test)}


def run_all(folder: Path, variants: tuple[Variant, ...] = VARIANTS) -> Results:
    """Fetch once and run every variant."""
    started = time.monotonic()
    root = fetch(folder)
    fetched = time.monotonic() - started
    runs = {v.name: run(root, v, folder / "runs" / v.name) for v in variants}
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
