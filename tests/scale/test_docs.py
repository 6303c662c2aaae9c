"""docs/deployment.md: its python blocks run, in order, in one namespace, in a fresh folder."""

from __future__ import annotations

import os
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_the_deployment_page_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in [n for n in os.environ if n.startswith("TOOLGUARD_")]:
        monkeypatch.delenv(name)
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) >= 2
    namespace: dict[str, object] = {"__name__": "docs_deployment"}
    for number, code in enumerate(blocks, start=1):
        exec(compile(code, f"{DOC.name} block {number}", "exec"), namespace)
