"""The guarded store: the data tier decides whether a fenced write may land.

>>> from toolguard.locks import connect
>>> from toolguard.store import IntentRecord, open_store
>>> locks = connect("redis://127.0.0.1:6379/0")
>>> store = open_store("postgresql://app@db/crm")   # or "sqlite:///path/to.db"
>>> store.install()
>>> intent = IntentRecord(tool="deposit", idempotency_key="run-7/call-3",
...                       args_hash=args_hash(args), agent="payments", keys=("account:42",))
>>> with locks.acquire(["account:42"]) as lease:
...     with store.fenced(lease, intent) as tx:
...         (balance,) = tx.execute("SELECT balance FROM account WHERE id = %s", (42,)).fetchone()
...         tx.execute("UPDATE account SET balance = %s WHERE id = %s", (balance + 10, 42),
...                    expect_rows=1)
...         tx.record({"balance": balance + 10})

``fenced(lease, intent)`` checks the lease right before the commit
(``LockLost`` if it was lost or released meanwhile): the same check
``ToolGuard.run`` makes. ``fenced(lease.tokens, intent)`` still
works, without that check. ``expect_rows=n`` makes a statement that matches
another number of rows an error (``RecordNotFound`` for fewer, ``TooManyRows``
for more) that rolls the transaction back, never a silent no-op.

``fenced()`` opens one transaction that first checks and advances the fence of
every key (sorted, so two writers cannot deadlock in the database): a token
lower than one the store has seen for that key is rejected with
``StaleFencingToken``; an equal one is accepted (one lease, several writes).
Then it creates or locks the intent's idempotency row (``DuplicateIntent``
with the recorded result if it was applied before: nothing runs;
``IdempotencyConflict`` for the same key with other arguments), lets the tool
run its SQL on the same connection, records the result, writes the accepted
audit row and commits: all or nothing. A rejected or failed write is rolled
back and audited outside the transaction, and its intent is recorded as
'failed' (or 'unknown' when cancelled), to be reconciled by the next attempt.
``begin_intent(intent)`` (``Begun`` or ``Replay``) reserves the key in a round
trip of its own, for callers who want to know about a replay before locking;
``run_fenced`` does without it.

Why the reads must happen inside the fenced transaction
-------------------------------------------------------
Fencing only the write does not prevent lost updates. Holder A reads a
balance, then pauses (GC, a slow model call, a stopped process) past its TTL;
B takes the lock with a newer token and reads the same balance. If A wakes
*between B's read and B's write*, A's write still carries the newest token the
store has seen, so it is accepted; then B's write is accepted too (B's token
is newer) and silently overwrites A's update with a value computed from a
stale read. When the read happens inside ``fenced()`` instead, the fence row
is already locked and advanced when the tool reads: a holder with an older
token is rejected before it reads anything, and a newer holder waits for the
commit of the older one and then reads its result. So: read what a write
depends on through ``tx``, never before entering ``fenced()``. Run PostgreSQL
at READ COMMITTED (the default): each statement then sees the commits of
every earlier fence holder; every writer of the data must fence the same keys.

A holder paused inside its fenced transaction (a stopped process) keeps its
fence rows locked. On PostgreSQL the next holder ends that transaction once the
paused holder's lease is gone (its token for the key is newer), never before:
a live holder is never cut (``toolguard/sql/README.md``). On SQLite nothing can
end it; the late commit is still refused by the lease check.

Results are JSON: ``json.dumps(value, allow_nan=False)`` with valid Unicode
strings, replayed as ``json.loads`` of that text, identically on both stores
(NUL, key order and ``1e16`` included); a lone surrogate is refused
(``not_json``).

Tools whose side effect cannot check a token (an external API) get no such
guarantee from the store: there the lock is only an efficiency measure and the
idempotency key (passed on to the API) is what prevents duplicates.

Rejections raise typed errors mapped from the SQLSTATE class ``TG`` (see
``toolguard/sql/README.md``): TG001 ``StaleFencingToken``, TG002
``InvalidFencingToken``, TG003 ``RecordNotFound``, TG004
``IdempotencyConflict``, TG005 ``AuditAppendOnly``.

Recovery: ``run_fenced(locks, store, keys, body)`` locks, writes and
releases, and when the lock server regressed (it issued a token below the
store's high-water mark while the lease is still held) re-seeds it from the
store and retries once. Callers who acquire first and write later get the same
step from ``reseed_if_regressed(locks, store, lease, stale)`` (see
``toolguard.store.recovery``); ``reseed`` raises the floors at any time.

The audit log is tamper-evident: every row carries a hash of its content
(``row_hash``, taken in the database) and the version of the policy that
decided (``policy_version``); ``seal_audit()`` links closed ranges of rows into a
chain of seals without ever making writers wait; ``verify_audit(anchor=...)``
reports a changed, deleted or inserted row, or a changed seal, by id; and
``export_audit(path, before=..., drop=True)`` moves old sealed ranges to a file
that verifies on its own (``read_export``) while what remains still verifies.
See ``docs/audit.md``.

Names: ``open_store``/``open_async_store`` pick the backend by URL scheme
(``postgresql://``/``postgres://`` or ``sqlite:///``); ``install=True`` installs
or upgrades the schema (the async store does it before its first operation). The async store has the
same methods as coroutines and ``async with store.fenced(...)``. Beyond the
core shape, ``high_waters(keys)`` (one query for several keys, used by the
re-seed), ``connection()`` (a raw autocommit connection for reads and setup) and
``install(steps=...)`` (explicit migrations, for tests of the upgrade path) are
public too.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from toolguard.errors import ConfigurationError
from toolguard.runtime.extras import require
from toolguard.store.autoseal import AutoSeal
from toolguard.store.base import (
    DECISIONS,
    SQLSTATES,
    AsyncFencedTransaction,
    AsyncGuardedStore,
    AuditEntry,
    AuditQuery,
    Begun,
    Decision,
    FencedTransaction,
    FenceSource,
    GuardedStore,
    HeldLease,
    IntentRecord,
    IntentStatus,
    Migration,
    Replay,
    latest_version,
    migrations,
)
from toolguard.store.chain import (
    GENESIS,
    AuditVerification,
    ChainHead,
    ExportCheck,
    ExportResult,
    Problem,
    SealResult,
    read_export,
)
from toolguard.store.recovery import (
    Outcome,
    areseed,
    areseed_if_regressed,
    arun_fenced,
    lock_regressed,
    reseed,
    reseed_if_regressed,
    run_fenced,
)

__all__ = [
    "DECISIONS",
    "GENESIS",
    "SQLSTATES",
    "AsyncFencedTransaction",
    "AsyncGuardedStore",
    "AuditEntry",
    "AuditQuery",
    "AuditVerification",
    "AutoSeal",
    "Begun",
    "ChainHead",
    "Decision",
    "ExportCheck",
    "ExportResult",
    "FenceSource",
    "FencedTransaction",
    "GuardedStore",
    "HeldLease",
    "IntentRecord",
    "IntentStatus",
    "Migration",
    "Outcome",
    "Problem",
    "Replay",
    "SealResult",
    "areseed",
    "areseed_if_regressed",
    "arun_fenced",
    "latest_version",
    "lock_regressed",
    "migrations",
    "open_async_store",
    "open_store",
    "read_export",
    "reseed",
    "reseed_if_regressed",
    "run_fenced",
]

POSTGRES_SCHEMES = ("postgresql", "postgres")


def _scheme(url: str) -> str:
    if not isinstance(url, str) or "://" not in url:
        msg = f"a store URL looks like postgresql://user@host/db or sqlite:///path.db, got {url!r}"
        raise ConfigurationError(msg)
    scheme = urlparse(url).scheme
    if scheme not in (*POSTGRES_SCHEMES, "sqlite"):
        msg = f"unknown store URL scheme {scheme!r}; expected postgresql:// or sqlite:///"
        raise ConfigurationError(msg)
    return scheme


def open_store(url: str | None = None, *, install: bool = False, **options: Any) -> GuardedStore:
    """A sync ``GuardedStore`` for ``url`` (default: settings, i.e. the embedded SQLite file).

    PostgreSQL options: ``schema``, ``min_size``, ``max_size``, ``timeout_s``,
    ``prepare_threshold`` (None behind PgBouncer in transaction mode);
    SQLite options: ``busy_timeout_ms``, ``synchronous``; both: ``autoseal`` (an
    ``AutoSeal``, the default seals within 1 s or 1,000 rows and at close; None: seal
    by hand). ``install=True`` installs or upgrades the schema first.
    """
    if url is None:
        from toolguard.config import Settings

        url = Settings().resolved_store_url()
    store: GuardedStore
    if _scheme(url) == "sqlite":
        from toolguard.locks import sqlite_path
        from toolguard.store.sqlite import SqliteStore

        store = SqliteStore(sqlite_path(url), **options)
    else:
        require("postgres", "the PostgreSQL store")
        from toolguard.store.postgres import PostgresStore

        store = PostgresStore(url, **options)
    if install:
        try:
            store.install()
        except BaseException:
            store.close()
            raise
    return store


def open_async_store(url: str | None = None, *, install: bool = False,
                     **options: Any) -> AsyncGuardedStore:
    """An ``AsyncGuardedStore`` for ``url``; its pool opens on first use.

    Options as ``open_store``. ``install=True`` installs or upgrades the schema
    before the store's first operation: this function is not a coroutine, so
    the first awaited call runs it (and raises its error, e.g.
    ``BackendUnavailable``; the next call tries again). ``await store.install()``
    does it at once.
    """
    if url is None:
        from toolguard.config import Settings

        url = Settings().resolved_store_url()
    if _scheme(url) == "sqlite":
        from toolguard.locks import sqlite_path
        from toolguard.store.sqlite import AsyncSqliteStore

        return AsyncSqliteStore(sqlite_path(url), install=install, **options)
    require("postgres", "the PostgreSQL store")
    from toolguard.store.postgres import AsyncPostgresStore

    return AsyncPostgresStore(url, install=install, **options)
