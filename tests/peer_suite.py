"""What the peers' own test suites (LangGraph prebuilt's, LangChain's agents') share here.

Each suite is fetched as the source distribution of the *installed* package
(nothing of it is kept in this repository), checked to ship the installed
sources byte for byte, run unmodified in a subprocess with a pytest plugin of
ours that injects toolguard and writes a per-test ``summary.json``.
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class SuiteUnavailable(Exception):
    """The suite could not be fetched or its test dependencies are missing."""


def missing_dependencies(dependencies: Mapping[str, str]) -> list[str]:
    """The distributions of ``{module: distribution}`` whose module is not importable."""
    missing = []
    for module, distribution in dependencies.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:  # a parent package is missing
            found = False
        if not found:
            missing.append(distribution)
    return missing


def installed_version(package: str) -> str:
    return importlib.metadata.version(package)


def fetch_sdist(folder: Path, package: str, *, installed: Path, shipped: str,
                timeout_s: float) -> Path:
    """Download and unpack the installed ``package``'s sdist; check that its ``shipped``
    folder is the ``installed`` one byte for byte, remove its top package (the tests
    must import the installed one), and return the unpacked root."""
    version = installed_version(package)
    download = folder / "download"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "--dest", str(download),
               f"{package}=={version}"]
    if importlib.util.find_spec("hatchling") is not None:
        # pip prepares the sdist's metadata with its build backend (hatchling); installed,
        # it need not fetch one into an isolated build environment first.
        command.append("--no-build-isolation")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    archives = sorted(download.glob("*.tar.gz"))
    if done.returncode != 0 or not archives:
        raise SuiteUnavailable(f"pip download {package}=={version} failed: "
                               f"{(done.stderr or done.stdout).strip()[-2000:]}")
    with tarfile.open(archives[0]) as archive:
        archive.extractall(folder / "src", filter="data")
    (root,) = (folder / "src").iterdir()
    check_same_sources(root / shipped, installed)
    shutil.rmtree(root / Path(shipped).parts[0])
    return root


def check_same_sources(shipped: Path, installed: Path) -> None:
    """``shipped`` must hold the same Python files as ``installed``, byte for byte."""
    names = {p.relative_to(shipped) for p in shipped.rglob("*.py")}
    if names != {p.relative_to(installed) for p in installed.rglob("*.py")}:
        raise SuiteUnavailable(f"{shipped} and {installed} hold different files")
    changed = [str(name) for name in sorted(names)
               if (shipped / name).read_bytes() != (installed / name).read_bytes()]
    if changed:
        raise SuiteUnavailable(f"the sdist's sources differ from the installed ones: {changed}")


@dataclass(frozen=True)
class Finished:
    """One subprocess run of a suite: the plugin's per-test summary and how it ended."""

    tests: dict[str, dict[str, Any]]
    returncode: int
    seconds: float
    log: Path


def run_suite(root: Path, out: Path, name: str, *, plugin_dir: Path,
              environment: Mapping[str, str], arguments: Sequence[str],
              timeout_s: float) -> Finished:
    """``pytest arguments`` in ``root``, in a subprocess with ``plugin_dir`` on its path and
    ``environment`` set (the suite's own ``LANGGRAPH_TEST_FAST`` default: in-memory
    checkpointers and stores only); the summary the plugin wrote to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("PYTEST_", "TOOLGUARD_SUITE_"))}
    env.update(environment)
    env.update({
        "TOOLGUARD_SUITE_DIR": str(out),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_dir), env.get("PYTHONPATH")])),
        "LANGGRAPH_TEST_FAST": "true",
    })
    log = out / "pytest.log"
    command = [sys.executable, "-m", "pytest", *arguments, "-p", "no:cacheprovider", "-q"]
    started = time.monotonic()
    with log.open("w") as sink:
        done = subprocess.run(command, cwd=root, env=env, stdout=sink, stderr=subprocess.STDOUT,
                              timeout=timeout_s)
    seconds = time.monotonic() - started
    summary_path = out / "summary.json"
    if not summary_path.exists():
        raise SuiteUnavailable(f"{name}: no summary (exit {done.returncode}); see {log}")
    return Finished(json.loads(summary_path.read_text())["tests"], done.returncode, seconds, log)
