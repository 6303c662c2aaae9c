"""``@guarded`` keeps the function's type, and ``current().tx`` is typed: checked with mypy.

The decorator used to return an untyped ``GuardedFunction``: a wrong argument
type passed silently until the guard refused it at run time, and the result
was ``Any``. Needs mypy (``pip install mypy``); the test is skipped without it,
which is not a pass.
"""

from __future__ import annotations

import re
import tempfile
import textwrap
from pathlib import Path

import pytest

SNIPPET = '''
from toolguard import ToolGuard, current
from toolguard.adapters import guarded
from toolguard.store.base import AsyncFencedTransaction, FencedTransaction

def make(guard: ToolGuard) -> None:
    @guarded(guard, agent="scorer")
    def add_score(lead_id: str, delta: int) -> int:
        tx: FencedTransaction = current().tx
        tx.execute("SELECT 1")
        return delta

    @guarded(guard, agent="scorer")
    async def aadd_score(lead_id: str, delta: int) -> int:
        atx: AsyncFencedTransaction = current().atx
        await atx.execute("SELECT 1")
        return delta

    score: int = add_score("L-1", 5)
    add_score("L-1", "5")  # expect: a wrong argument type
    text: str = add_score("L-1", 5)  # expect: the result type flows through
    add_score(lead="L-1", delta=5)  # expect: an unknown keyword

    async def later() -> int:
        return await aadd_score("L-1", 5)

    reveal_type(current().tx)  # expect
'''


def test_guarded_is_typed_like_the_function_and_current_tx_is_typed(tmp_path: Path) -> None:
    api = pytest.importorskip("mypy.api")
    source = tmp_path / "snippet.py"
    text = textwrap.dedent(SNIPPET).lstrip("\n")
    source.write_text(text, encoding="utf-8")
    wrong, result, keyword, revealed = [number for number, line in
                                        enumerate(text.splitlines(), start=1) if "# expect" in line]
    cache = Path(tempfile.gettempdir()) / "toolguard-mypy-cache"
    out, err, _ = api.run(["--strict", "--follow-imports=silent", "--no-error-summary",
                           "--cache-dir", str(cache), str(source)])

    found = {int(m.group(1)): m.group(2)
             for m in re.finditer(r"snippet\.py:(\d+): (error: .*|note: Revealed .*)", out)}
    assert set(found) == {wrong, result, keyword, revealed}, out + err
    assert 'Argument 2 to "__call__" of "GuardedFunction" has incompatible type "str"; ' \
           'expected "int"' in found[wrong]
    assert 'Incompatible types in assignment (expression has type "int"' in found[result]
    assert 'Unexpected keyword argument "lead"' in found[keyword]
    assert 'Revealed type is "toolguard.store.base.FencedTransaction"' in found[revealed]
