"""Which identity a guarded call takes inside DBOS: the step's, numbered per call; none outside.

Runs DBOS on a SQLite system database in a process of its own (DBOS is one
instance per process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json
    from dbos import DBOS, SetWorkflowID
    from toolguard import Policy, ToolGuard, connect, current, guarded, open_store

    guard = ToolGuard(Policy.from_dict({"version": 1, "tools": {"note": {"locks": ["n:{text}"]}}}),
                      locks=connect(), store=open_store(install=True))

    @guarded(guard, agent="writer")
    def note(text: str) -> str:
        return current().idempotency_key

    @DBOS.step()
    def two_notes() -> list:
        return [note(text="a"), note.run({"text": "b"}).result, note.run({"text": "c"},
                call_id="mine", thread_id="t").result]

    @DBOS.workflow()
    def flow() -> dict:
        return {"step": two_notes(), "again": two_notes(), "body": note(text="d")}

    DBOS(config={"name": "identity", "system_database_url": "sqlite:///dbos.sqlite"})
    DBOS.launch()
    with SetWorkflowID("wf-1"):
        print(json.dumps(flow()))
    DBOS.destroy()
""")


def test_calls_in_a_step_take_its_identity_in_order(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin",
                                                       "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    keys = json.loads(done.stdout.strip().splitlines()[-1])
    assert keys["step"] == ["run:dbos%3Awf-1//step-1", "run:dbos%3Awf-1//step-1.2",
                            "thread:t//mine"]  # an identity given by the caller is kept
    assert keys["again"][:2] == ["run:dbos%3Awf-1//step-2", "run:dbos%3Awf-1//step-2.2"]
    assert keys["body"] is None or not keys["body"].startswith("run:dbos")  # not a step: none
