"""Which providers toolguard reports to, and what happens without any or without the package.

Each case runs in a fresh interpreter: the global providers can be set only
once per process, and "not installed" means ``opentelemetry`` cannot be
imported at all (``sys.modules[name] = None``, as tests/test_core_without_extras.py
does for every extra).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from toolguard.runtime.extras import DISTRIBUTION

POLICY = 'version: 1\ntools:\n  deposit:\n    locks: ["account:{account_id}"]\n'
SETUP = """
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
"""


def run_python(code: str, cwd: Path, *, without_otel: bool = False) -> str:
    (cwd / "policy.yml").write_text(POLICY)
    block = "import sys\n" + ("sys.modules['opentelemetry'] = None\n" if without_otel else "")
    script = block + textwrap.dedent(SETUP) + textwrap.dedent(code)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120, cwd=cwd, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_without_the_package_nothing_is_imported_and_calls_run(tmp_path: Path) -> None:
    out = run_python("""
        import json
        from toolguard.runtime import telemetry
        from toolguard.runtime.extras import MissingExtra

        decision = deposit.run({"account_id": "A-1", "amount": 5}, call_id="c1", thread_id="t")
        loaded = sorted(m for m, mod in sys.modules.items()
                        if mod is not None and m.split(".")[0] == "opentelemetry")
        try:
            telemetry.use_providers()
            asked = None
        except MissingExtra as error:
            asked = str(error)
        print(json.dumps([decision.kind, decision.result, telemetry.available(), loaded,
                          telemetry.start_call(decision.intent, guard.policy.tools)
                          is telemetry.NO_CALL, asked]))
    """, tmp_path, without_otel=True)
    kind, result, available, loaded, no_call, asked = json.loads(out)
    assert (kind, result, available, loaded, no_call) == ("accepted", 105, False, [], True)
    assert f"pip install '{DISTRIBUTION}[otel]'" in asked


def test_with_no_provider_configured_a_call_gets_the_shared_null_telemetry(
        tmp_path: Path) -> None:
    out = run_python("""
        import json
        from toolguard.runtime import telemetry
        from toolguard.call.intent import Intent

        intent = Intent(tool="deposit", call_id="c0", agent="teller")
        null = not telemetry.start_call(intent, guard.policy.tools).listening
        fenced = telemetry.start_fenced(None) is telemetry.NO_FENCED
        with telemetry.start_call(intent, guard.policy.tools):  # no second look inside a call
            fenced = fenced and telemetry.start_fenced(None) is telemetry.NO_FENCED
        decision = deposit.run({"account_id": "A-1", "amount": 5}, call_id="c1", thread_id="t")
        sdk = sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk"))
        print(json.dumps([null, fenced, decision.kind, telemetry.available(), sdk]))
    """, tmp_path)
    assert json.loads(out) == [True, True, "accepted", True, []]


def test_the_global_providers_are_used_once_the_application_sets_them(tmp_path: Path) -> None:
    """No toolguard-specific setup: the application sets the global providers (even after
    the guard was built and used) and the next call reports to them."""
    out = run_python("""
        import json
        from opentelemetry import metrics, trace
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

        deposit.run({"account_id": "A-1", "amount": 5}, call_id="before", thread_id="t")
        exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        trace.set_tracer_provider(provider)
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))

        deposit.run({"account_id": "A-1", "amount": 5}, call_id="after", thread_id="t")
        calls = [s.attributes["gen_ai.tool.call.id"] for s in exporter.get_finished_spans()
                 if s.name == "execute_tool deposit"]
        points = [(m.name, p.value) for r in reader.get_metrics_data().resource_metrics
                  for sm in r.scope_metrics if sm.scope.name == "toolguard"
                  for m in sm.metrics if m.name == "toolguard.decisions"
                  for p in m.data.data_points]
        print(json.dumps([calls, points]))
    """, tmp_path)
    assert json.loads(out) == [["after"], [["toolguard.decisions", 1]]]
