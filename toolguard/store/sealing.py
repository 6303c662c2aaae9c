"""Sealing, verifying and exporting the audit log: the I/O around ``toolguard.store.chain``.

One flow for both stores; each store gives a ``ChainIO`` (its queries) and the
transaction each step needs. These are batch jobs, not the hot path: the async
stores run them in a worker thread on a connection of their own.

The flow is in ``toolguard.store.sealing_flow``, each dialect's queries and
transactions in ``toolguard.store.sealing_postgres`` (with why a PostgreSQL seal
never covers an id that can still commit) and ``toolguard.store.sealing_sqlite``;
this module is their one import path.
"""

from __future__ import annotations

from toolguard.store.sealing_flow import (
    MAX_SEAL_ROWS,
    ChainIO,
    check_anchors,
    export_log,
    seal_log,
    verify_log,
)
from toolguard.store.sealing_flow import ExportPlan as ExportPlan
from toolguard.store.sealing_flow import plan_export as plan_export
from toolguard.store.sealing_flow import retention_problems as retention_problems
from toolguard.store.sealing_flow import seal_rows as seal_rows
from toolguard.store.sealing_flow import start_of as start_of
from toolguard.store.sealing_flow import unsealed_notes as unsealed_notes
from toolguard.store.sealing_postgres import PgChainIO, pg_export, pg_seal, pg_verify
from toolguard.store.sealing_postgres import pg_transaction as pg_transaction
from toolguard.store.sealing_sqlite import SqliteChainIO, sqlite_export, sqlite_seal, sqlite_verify
from toolguard.store.sealing_sqlite import sqlite_drop as sqlite_drop
from toolguard.store.sealing_sqlite import sqlite_immediate as sqlite_immediate
from toolguard.store.sealing_sqlite import sqlite_snapshot as sqlite_snapshot

__all__ = ["MAX_SEAL_ROWS", "ChainIO", "PgChainIO", "SqliteChainIO", "check_anchors", "export_log",
           "pg_export", "pg_seal", "pg_verify", "seal_log", "sqlite_export", "sqlite_seal",
           "sqlite_verify", "verify_log"]
