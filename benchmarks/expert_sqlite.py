"""What an expert writes by hand to get a guarded call's guarantees on embedded SQLite alone.

The reference ``benchmarks/deployments.py`` holds toolguard's SQLite deployment
(locks and store in one SQLite file) to. Same guarantees as toolguard: a lease
with a fencing token, a fence check and advance in the data's database, an
idempotency record with the recorded result, a hash-chained audit row, all in
one serialized transaction. The same file, WAL and ``synchronous=NORMAL`` as
toolguard's stores and lock backend; one connection per thread (``sqlite3``,
``isolation_level=None``, a 30 s busy timeout), statements cached by sqlite3.

* The lease: one autocommit upsert on ``x_lock`` takes the key if it is free or
  its lease expired and advances the key's counter in the same row, which is
  the fencing token (``RETURNING token``); nothing returned: taken, sleep
  0.5 ms and try again. The release is one ``UPDATE`` that expires the lease if
  the owner still holds it (the row, and so the counter, stays).
* The fenced write, one ``BEGIN IMMEDIATE`` transaction (SQLite's write lock
  until ``COMMIT``: serializable, as toolguard's):

  1. one upsert on ``x_fence`` that advances the token only if it is not below
     the stored one and advances the key's sha256 audit chain in the same
     statement (``x_link``, a registered function; nothing returned: stale,
     rolled back);
  2. a primary-key read of the intent row: when it exists the call is a replay,
     its recorded result is the answer (the transaction is rolled back and the
     fence alone advanced and committed, so the store still refuses lower
     tokens; the chain stays as it was);
  3. the tool's ``UPDATE ... RETURNING``;
  4. the intent row with its result, one ``INSERT``;
  5. the audit row (agent, tool, key, token, decision, arguments as JSON, time,
     the chain's new head as its hash), one ``INSERT``; ``COMMIT``.

``check()`` proves the run kept the guarantees (``expert.check_tables``): one
intent and one audit row per call, every chain recomputes from its rows.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
import uuid
from typing import Any

from expert import Stale, check_tables, entry_text

TABLES = """
CREATE TABLE IF NOT EXISTS x_lock (key TEXT PRIMARY KEY, owner TEXT NOT NULL,
                                   expires_us INTEGER NOT NULL, token INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS x_fence (key TEXT PRIMARY KEY, token INTEGER NOT NULL,
                                    chain BLOB NOT NULL DEFAULT x'');
CREATE TABLE IF NOT EXISTS x_intent (id TEXT PRIMARY KEY, key TEXT NOT NULL,
                                     token INTEGER NOT NULL, result TEXT);
CREATE TABLE IF NOT EXISTS x_audit (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, agent TEXT NOT NULL, tool TEXT NOT NULL,
    key TEXT NOT NULL, token INTEGER NOT NULL, decision TEXT NOT NULL, args TEXT NOT NULL,
    at TEXT NOT NULL DEFAULT (strftime('%Y-%m-%dT%H:%M:%fZ', 'now')), hash BLOB NOT NULL);
"""

#: Grant if free or expired, and the next token, in one statement.
ACQUIRE = ("INSERT INTO x_lock (key, owner, expires_us, token) VALUES (?1, ?2, ?3 + ?4, 1) "
           "ON CONFLICT (key) DO UPDATE SET owner = excluded.owner, "
           "expires_us = excluded.expires_us, token = x_lock.token + 1 "
           "WHERE x_lock.expires_us <= ?3 RETURNING token")
RELEASE = "UPDATE x_lock SET expires_us = 0 WHERE key = ? AND owner = ? AND expires_us > 0"
#: Fence check + advance and the chain's next link; nothing returned: stale.
FENCE = ("INSERT INTO x_fence (key, token, chain) VALUES (?1, ?2, x_link(x'', ?3)) "
         "ON CONFLICT (key) DO UPDATE SET token = excluded.token, "
         "chain = x_link(x_fence.chain, ?3) WHERE x_fence.token <= excluded.token RETURNING chain")
#: A replay's fence advance alone (the chain does not move: no audit row).
FENCE_ONLY = ("INSERT INTO x_fence (key, token) VALUES (?1, ?2) ON CONFLICT (key) DO UPDATE "
              "SET token = excluded.token WHERE x_fence.token <= excluded.token RETURNING 1")
RECORDED = "SELECT result FROM x_intent WHERE id = ?"
INTENT = "INSERT INTO x_intent (id, key, token, result) VALUES (?, ?, ?, ?)"
AUDIT = ("INSERT INTO x_audit (agent, tool, key, token, decision, args, hash) "
         "VALUES (?, ?, ?, ?, 'accepted', ?, ?)")
UPDATE = "UPDATE lead SET score = score + ? WHERE id = ? RETURNING score"
TTL_US = 10_000_000
SPIN_S = 0.0005


def _link(chain: bytes, entry: str) -> bytes:
    return hashlib.sha256(chain + entry.encode()).digest()


class ExpertSqlite:
    """The hand-written guarded call on one SQLite file, a connection per thread."""

    def __init__(self, path: str, *, busy_timeout_s: float = 30.0) -> None:
        self.path = path
        self.busy_timeout_s = busy_timeout_s
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._calls = 0
        self.conn().executescript(TABLES)

    def conn(self) -> sqlite3.Connection:
        db: sqlite3.Connection | None = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=self.busy_timeout_s, isolation_level=None,
                                 check_same_thread=False, cached_statements=64)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.create_function("x_link", 2, _link, deterministic=True)
            self._local.db = db
            with self._lock:
                self._all.append(db)
        return db

    @property
    def calls(self) -> int:
        return self._calls

    def call(self, lead: str) -> Any:
        db = self.conn()
        key = f"lead:{lead}"
        owner = uuid.uuid4().hex
        while True:
            row = db.execute(ACQUIRE, (key, owner, time.time_ns() // 1000, TTL_US)).fetchone()
            if row is not None:
                break
            time.sleep(SPIN_S)
        try:
            return self._transaction(db, lead, key, row[0], uuid.uuid4().hex)
        finally:
            db.execute(RELEASE, (key, owner))

    def _transaction(self, db: sqlite3.Connection, lead: str, key: str, token: int,
                     intent: str) -> Any:
        args = json.dumps({"lead_id": lead, "delta": 1}, separators=(",", ":"), sort_keys=True)
        db.execute("BEGIN IMMEDIATE")
        try:
            linked = db.execute(FENCE, (key, token, entry_text("scorer", "add_score", key, token,
                                                                args))).fetchone()
            if linked is None:
                raise Stale(key)
            recorded = db.execute(RECORDED, (intent,)).fetchone()
            if recorded is not None:  # a replay: the fence advances, nothing else
                db.execute("ROLLBACK")
                db.execute("BEGIN IMMEDIATE")
                db.execute(FENCE_ONLY, (key, token)).fetchall()
                db.execute("COMMIT")
                return json.loads(recorded[0])
            (score,) = db.execute(UPDATE, (1, lead)).fetchone()
            db.execute(INTENT, (intent, key, token, json.dumps(score)))
            db.execute(AUDIT, ("scorer", "add_score", key, token, args, linked[0]))
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                db.execute("ROLLBACK")
            raise
        with self._lock:
            self._calls += 1
        return score

    def check(self) -> list[str]:
        """What does not hold after the run (empty: every guarantee held)."""
        return check_tables(self.conn(), self._calls)

    def close(self) -> None:
        with self._lock:
            every, self._all = self._all, []
        for db in every:
            db.close()
