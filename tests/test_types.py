"""The package type-checks: mypy with the project's own configuration reports nothing.

``[tool.mypy]`` in pyproject.toml (strict, python 3.11, the ``toolguard``
package) is what ``.venv/bin/mypy`` runs from the repository root; this test runs
exactly that, so a change that breaks the typed public API fails the suite and
names every error. mypy is in the dev extra, which CI installs.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_package_passes_mypy_with_the_project_configuration() -> None:
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=280)
    problems = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert done.returncode == 0 and not problems, (
        f"mypy (pyproject.toml [tool.mypy]) found {len(problems)} error(s):\n"
        + "\n".join(problems or [done.stdout, done.stderr]))
    assert done.stdout.startswith("Success: no issues found"), done.stdout + done.stderr
