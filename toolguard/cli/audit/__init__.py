"""``toolguard audit``: what the agents did, and what they tried that the guard refused.

``toolguard audit --rejected`` answers "what did the agents try that we refused,
and why" in one command; ``list`` filters, ``show ID`` prints one entry in full,
``stats`` counts by reason and tool (optionally per hour or day). ``--json`` and
``--csv`` give the same rows to other tools.

The log is tamper-evident: ``seal`` links the rows written so far into a chain
of seals, ``verify`` reports any row changed, deleted or inserted (and any seal
changed) by id, and prints the latest seal's hash to keep elsewhere
(``verify --anchor HASH`` then also catches a rewrite of the whole chain);
``export --before WHEN --out FILE [--drop]`` moves old sealed ranges to a file
that verifies on its own (``check-export FILE``).

The commands are built like ``toolguard`` itself: this module makes the typer
group and registers the commands from their modules, ``listing`` (the group's
own listing, ``list``, ``show``), ``stats``, and ``chain`` (``seal``,
``verify``, ``export``, ``check-export``); ``filters`` holds the options they
share, ``format`` the vocabulary and row formatting (the review page uses them too).
"""

from __future__ import annotations

import typer

from toolguard.cli._common import EXIT_CODES_HELP
from toolguard.cli.audit.chain import (
    check_export_command,
    export_command,
    seal_command,
    verify_command,
)
from toolguard.cli.audit.filters import AuditFilters
from toolguard.cli.audit.listing import audit, list_command, show_command
from toolguard.cli.audit.stats import stats_command
from toolguard.store.audit_view import DECISIONS, REASONS, visible

__all__ = ["DECISIONS", "REASONS", "AuditFilters", "audit_app", "visible"]

audit_app = typer.Typer(
    name="audit",
    help="Review the audit log: every decision the guard took, accepted or refused.\n\n"
         "With no command it lists the newest entries: `toolguard audit --rejected` shows what "
         "the agents tried that was refused, and why. Filters given before a command apply to "
         "it (`toolguard audit --tool set_tier stats`). Times are UTC.\n\n" + EXIT_CODES_HELP,
    no_args_is_help=False, invoke_without_command=True, pretty_exceptions_enable=False)

audit_app.callback()(audit)
audit_app.command("list")(list_command)
audit_app.command("show")(show_command)
audit_app.command("stats")(stats_command)
audit_app.command("seal")(seal_command)
audit_app.command("verify")(verify_command)
audit_app.command("export")(export_command)
audit_app.command("check-export")(check_export_command)
