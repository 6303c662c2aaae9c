"""The ``toolguard`` command line."""

from __future__ import annotations

import typer

from toolguard import __version__

app = typer.Typer(help="toolguard: fenced locks, exactly-once intents and an audit log "
                       "between LLM agents and the records they change.", no_args_is_help=True)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"toolguard {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")) -> None:
    """toolguard: guard LLM tool calls with fenced locks, idempotency and an audit log."""


@app.command("version")
def version_command() -> None:
    """Print the version."""
    typer.echo(f"toolguard {__version__}")
