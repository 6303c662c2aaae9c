"""The core works with no extra installed; a missing extra is named; ``import toolguard`` is light.

Each check runs in a fresh interpreter in which the extras' modules cannot be
imported (``sys.modules[name] = None`` is how Python marks a module as
unimportable), the state of an environment where only ``toolguard-fenced`` was
installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from toolguard.runtime.extras import DISTRIBUTION, EXTRAS

ROOT = Path(__file__).resolve().parents[1]
BLOCK = textwrap.dedent(f"""\
    import sys
    for name in {sorted({m for mods in EXTRAS.values() for m in mods})!r}:
        sys.modules[name] = None
""")


def run_without_extras(code: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    script = BLOCK + textwrap.dedent(code)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def test_import_toolguard_loads_no_models_no_metadata_no_extras(tmp_path: Path) -> None:
    result = run_without_extras("""
        import toolguard
        heavy = [m for m in ("pydantic", "yaml", "asyncio", "importlib.metadata", "typer", "rich")
                 if sys.modules.get(m) is not None]
        print(heavy, toolguard.__version__)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("]")[0] == "[", result.stdout


def test_guarded_function_runs_on_the_embedded_default_without_extras(tmp_path: Path) -> None:
    (tmp_path / "policy.yml").write_text(
        'version: 1\ntools:\n  deposit:\n    locks: ["account:{account_id}"]\n')
    result = run_without_extras("""
        from toolguard import ToolGuard, connect, current, guarded, load_policy, open_store

        guard = ToolGuard(load_policy("policy.yml"), locks=connect(), store=open_store(install=True))
        with guard.store.connection() as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS accounts (id TEXT PRIMARY KEY, balance INT)")
            conn.execute("INSERT INTO accounts VALUES ('A-1', 100)")
            conn.commit()

        @guarded(guard, agent="teller")
        def deposit(account_id: str, amount: int) -> int:
            tx = current().tx
            tx.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, account_id))
            return tx.execute("SELECT balance FROM accounts WHERE id = %s", (account_id,)).fetchone()[0]

        print(deposit(account_id="A-1", amount=50))
        print(sorted(m for m, mod in sys.modules.items()
                     if mod is not None and m.split(".")[0] in ("langchain_core", "langgraph")))
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["150", "[]"]


@pytest.mark.parametrize(("code", "extra"), [
    ("from toolguard.adapters import GuardedToolCalls", "langgraph"),
    ("from toolguard.adapters import guard_tool", "langgraph"),
    ("from toolguard import connect; connect('redis://127.0.0.1:1/0')", "redis"),
    ("from toolguard import connect; connect('postgresql://127.0.0.1:1/x')", "postgres"),
    ("from toolguard import connect; connect('etcd://127.0.0.1:1/x')", "etcd"),
    ("from toolguard import open_store; open_store('postgresql://127.0.0.1:1/x')", "postgres"),
    ("from toolguard import open_async_store; open_async_store('postgresql://127.0.0.1:1/x')",
     "postgres"),
])
def test_a_missing_extra_is_named_with_its_install_line(tmp_path: Path, code: str, extra: str) -> None:
    result = run_without_extras(f"""
        from toolguard.runtime.extras import MissingExtra
        try:
            {code}
        except MissingExtra as error:
            print(error.reason, "|", error)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    reason, message = result.stdout.strip().split(" | ")
    assert reason == "missing_extra"
    assert f"pip install '{DISTRIBUTION}[{extra}]'" in message


def test_cli_names_the_extra_with_exit_2(tmp_path: Path) -> None:
    result = run_without_extras("""
        sys.argv = ["toolguard", "demo"]
        from toolguard.cli import app
        app()
    """, tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"pip install '{DISTRIBUTION}[langgraph]'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / ".toolguard").exists()


def test_pyproject_extras_match_the_code() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION
    assert isinstance(project["license"], str)  # SPDX, not the deprecated table
    extras = project["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    in_all = {name for spec in extras["all"] for name in spec.split("[")[1].rstrip("]").split(",")}
    assert all(spec.startswith(f"{DISTRIBUTION}[") for spec in extras["all"])
    assert set(EXTRAS) <= in_all, "every extra the code checks for belongs in [all]"
    assert f"{DISTRIBUTION}[all]" in extras["dev"]
    core = " ".join(project["dependencies"]).lower()
    for extra in EXTRAS:
        for requirement in extras[extra]:
            name = requirement.split("[")[0].split(">")[0].split("<")[0].strip().lower()
            assert name not in core, f"{name} is an extra ({extra}) but also a core dependency"


def test_names_and_submodules_resolve_lazily(tmp_path: Path) -> None:
    result = run_without_extras("""
        import toolguard
        assert toolguard.locks.connect is toolguard.connect      # a submodule as an attribute
        from toolguard import *                                   # every name in __all__
        assert ToolFailed.__module__ == "toolguard.call.decision" and callable(current_or_none)
        assert toolguard.guard.ToolFailed is ToolFailed and toolguard.guard.Decision is Decision
        # the errors a developer catches or filters, importable from the top without the guard
        assert issubclass(InvalidIntent, IntentRejected) and issubclass(MissingIdentity, NotAuthorized)
        assert issubclass(GuardMisconfigured, ConfigurationError)
        assert issubclass(UnknownToolWarning, UserWarning)
        try:
            toolguard.nothing_here
        except AttributeError as error:
            print(error)
    """, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "has no attribute 'nothing_here'" in result.stdout
