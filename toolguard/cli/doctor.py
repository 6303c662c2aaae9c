"""``toolguard doctor``: check a deployment against the operating checklist."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.text import Text

from toolguard.cli._common import (
    SchemaOption,
    TimeoutOption,
    console,
    failures,
)

__all__ = ["doctor"]

STYLE = {"pass": "bold green", "warn": "bold yellow", "fail": "bold red", "skip": "dim"}


def doctor(
    lock_url: Annotated[str | None, typer.Option(
        "--lock-url", metavar="URL",
        help="Lock server URL (redis://, redis+cluster://, redis+sentinel://, postgresql://, "
             "etcd://, sqlite:///). Default: TOOLGUARD_LOCK_URL, TOOLGUARD_REDIS_URL, else the "
             "embedded SQLite file.", show_default=False)] = None,
    lock_schema: Annotated[str | None, typer.Option(
        "--lock-schema", metavar="SCHEMA",
        help="PostgreSQL lock backend: the schema of its tables (connect(url, schema=...)). "
             "Default: the search_path.", show_default=False)] = None,
    store_url: Annotated[str | None, typer.Option(
        "--store-url", "--url", metavar="URL",
        help="Store URL. Default: TOOLGUARD_DATABASE_URL, else the embedded "
                                     "SQLite file.", show_default=False)] = None,
    schema: SchemaOption = None,
    policy: Annotated[list[Path] | None, typer.Option(
        "--policy", exists=True, readable=True, metavar="FILE",
        help="Check the TTLs and wait timeouts of this policy's tools too. Repeatable.",
        show_default=False)] = None,
    sample: Annotated[int, typer.Option(
        "--sample", min=1, metavar="N",
        help="Compare at most this many fenced keys (the most recently written) "
                                "with the lock server's counters.")] = 1000,
    reseed: Annotated[bool, typer.Option(
        "--reseed", help="Raise lagging lock counters to the store's high-water marks "
                         "(the only check that writes).")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 on warnings too.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="JSON for other tools.")] = False,
    timeout: TimeoutOption = 3.0,
) -> None:
    """Check a deployment against toolguard's operating checklist.

    Lock server and store reachable; Redis eviction policy and persistence (on every
    primary of a Redis Cluster, on the primary Sentinel names); clock skew; the store's
    schema version, and a PostgreSQL lock backend's; TTL vs renewal interval and round
    trip; the lock server's counters above the store's fencing high-water marks; whether a
    PostgreSQL store's role may end a paused holder's transaction (pg_signal_backend, or
    one role for every client). Each check prints pass, warn, fail or skip with why it
    matters. Exit 0 when nothing failed, 1 if a check fails (--strict: or warns), 2 on a
    usage error, 3 if a backend cannot be reached, 4 if one refused the connection.
    """
    from toolguard.cli.checks import exit_code, run_checks

    ttls: list[int] | None = None
    wait: float | None = None
    with failures():
        if policy:
            from toolguard.policies import load_policy

            loaded = load_policy(policy)
            ttls = sorted({loaded.defaults.ttl_ms, *(t.ttl_ms for t in loaded.tools.values())})
            wait = min([loaded.defaults.wait_timeout_s,
                        *(t.wait_timeout_s for t in loaded.tools.values())])
        checks = run_checks(lock_url=lock_url, store_url=store_url, schema=schema, ttl_ms=ttls,
                            wait_timeout_s=wait, timeout_s=timeout, sample=sample, reseed=reseed,
                            lock_schema=lock_schema)
    code = exit_code(checks, strict=strict)
    if json_out:
        typer.echo(json.dumps({"ok": code == 0, "exit_code": code,
                               "checks": [c.as_dict() for c in checks]}, indent=2, default=str))
        raise typer.Exit(code)
    out = console()
    for check in checks:
        line = Text()
        line.append(f"{check.status.upper():<5}", style=STYLE[check.status])
        line.append(f" {check.title}", style="bold")
        line.append(f"  {check.summary}")
        out.print(line, soft_wrap=True)
        if check.status in ("warn", "fail"):
            out.print(Text(f"      why: {check.why}", style="dim"), soft_wrap=True)
        if check.fix and check.status in ("warn", "fail"):
            out.print(Text(f"      fix: {check.fix}", style="cyan"), soft_wrap=True)
    counts = {s: sum(c.status == s for c in checks) for s in ("pass", "warn", "fail", "skip")}
    verdict = {0: ("ok", "bold green"), 1: ("checks failed", "bold red"),
               3: ("a backend is unreachable", "bold red"),
               4: ("a backend refused the connection", "bold red")}[code]
    out.print(Text.assemble((verdict[0], verdict[1]), f" — {counts['pass']} passed, "
                            f"{counts['warn']} warnings, {counts['fail']} failed, "
                            f"{counts['skip']} skipped (exit {code})"))
    raise typer.Exit(code)
