"""The ``toolguard`` command line (typer + rich).

Exit codes, the same for every command, so scripts can rely on them:

    0  ok
    1  a check or verification failed (doctor, demo, ``db status``, ``policy check``)
    2  usage error: a bad option, argument, file or URL
    3  a backend (lock server or store) cannot be reached
    4  the backend refused (permissions, a broken schema)

Expected failures print one line on stderr, never a traceback.
"""

from __future__ import annotations

from typing import Annotated

import typer

from toolguard import __version__
from toolguard.cli._common import EXIT_CODES_HELP
from toolguard.cli.approve import approve, deny
from toolguard.cli.audit import audit_app
from toolguard.cli.db import db_app
from toolguard.cli.demo import demo
from toolguard.cli.doctor import doctor
from toolguard.cli.keys import fence_app, keys_app
from toolguard.cli.mcp import mcp_app
from toolguard.cli.pause import pause, resume
from toolguard.cli.policy import policy_app
from toolguard.cli.policy_diff import policy_diff
from toolguard.cli.serve import serve

__all__ = ["app"]

HELP = f"""toolguard: fenced locks, exactly-once intents and an audit log between LLM agents and
the records they change.

Start with `toolguard demo` (runs offline; needs the [langgraph] extra), then
`toolguard audit --rejected`.
Settings come from TOOLGUARD_* variables: TOOLGUARD_REDIS_URL (locks),
TOOLGUARD_DATABASE_URL (store); with neither, everything lives in two SQLite files under
./.toolguard/ (locks.db, store.db).

{EXIT_CODES_HELP}"""

app = typer.Typer(name="toolguard", help=HELP, no_args_is_help=True, add_completion=False,
                  pretty_exceptions_enable=False, rich_markup_mode=None)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"toolguard {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """toolguard: guard LLM tool calls with fenced locks, idempotency and an audit log."""


@app.command("version")
def version_command() -> None:
    """Print the version."""
    typer.echo(f"toolguard {__version__}")


app.command("demo")(demo)
app.add_typer(audit_app, name="audit")
app.command("doctor")(doctor)
policy_app.command("diff")(policy_diff)
app.add_typer(policy_app, name="policy", help="Check toolguard policy files (file:line errors); "
                                              "diff two policies over the audit log.")
app.add_typer(db_app, name="db")
app.command("serve")(serve)
app.command("pause")(pause)
app.command("resume")(resume)
app.command("approve")(approve)
app.command("deny")(deny)
app.add_typer(keys_app, name="keys")
app.add_typer(fence_app, name="fence")
app.add_typer(mcp_app, name="mcp")
