"""A plain-Python guarded call and its refusals import no framework (issue 23, point 6).

With LangGraph installed, the first refusal used to import ``langgraph.errors``
(and with it LangChain: most of a second) to ask whether the error was
LangGraph's control flow. Such an exception can only exist once LangGraph is
loaded, so the check reads ``sys.modules`` and imports nothing. Runs in a
fresh interpreter with every extra installed (unlike ``test_core_without_extras``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("langgraph", "langchain", "langchain_core", "starlette", "httpx", "mcp", "fastmcp",
              "fastapi", "uvicorn")

SCRIPT = textwrap.dedent("""
    import json, sys
    from toolguard import ToolGuard, connect, guarded, open_store
    from toolguard.errors import ToolGuardError
    from toolguard.controls.pause import PauseBoard
    from toolguard.policies import Policy

    store = open_store("sqlite:///store.db", install=True)
    policy = Policy.from_dict({"version": 1, "tools": {
        "add": {"locks": ["n:{n}"], "agents": ["a"], "args": {"n": {"ge": 0, "le": 10}}},
        "halted": {"agents": ["a"], "read_only": True}}})
    guard = ToolGuard(policy, locks=connect("sqlite:///locks.db"), store=store, pause_cache_s=0)

    @guarded(guard, agent="a")
    def add(n: int) -> int:
        if n == 7:
            raise RuntimeError("seven")
        return n

    @guarded(guard, agent="a")
    def halted() -> int:
        return 1

    PauseBoard(store).pause("tool", "halted", by="ops", reason="test")
    texts = [add.run({"n": 1}, call_id="c1", thread_id="t").model_text(),
             add.run({"n": 1}, call_id="c1", thread_id="t").model_text(),
             add.run({"n": 50}, call_id="c2", thread_id="t").model_text(),
             add.run({"n": 7}, call_id="c3", thread_id="t").model_text(),
             halted.run({}, call_id="c4", thread_id="t").model_text()]
    try:
        add(n=50)
    except ToolGuardError as refused:
        texts.append(refused.reason)
    frameworks = sorted({m.split(".")[0] for m in sys.modules} & set(sys.argv[1].split(",")))
    print(json.dumps({"texts": texts, "frameworks": frameworks}))
""")


def test_a_plain_call_and_its_refusals_import_no_framework(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOOLGUARD_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(FRAMEWORKS)],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.strip().splitlines()[-1])
    texts = found["texts"]
    assert [text.split(":")[0] for text in texts[:5]] == [
        "completed (applied)", "completed (duplicate)", "rejected by toolguard (invalid_arguments)",
        "not completed (error)", "rejected by toolguard (paused)"]
    assert texts[5] == "invalid_arguments"
    assert found["frameworks"] == [], found
