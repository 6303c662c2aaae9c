"""What an expert writes by hand to get a guarded call's guarantees with PostgreSQL alone.

The reference ``benchmarks/deployments.py`` holds toolguard's PostgreSQL-only
deployment (the lock backend and the store in one PostgreSQL) to. The same
guarantees as ``expert.py``'s (d2), with the lease in PostgreSQL instead of
Redis, on the benchmark's pool (autocommit connections, pipeline mode,
statements prepared by psycopg after their first uses):

1. the lease: one autocommit upsert on ``x_lock`` takes the key if it is free or
   its lease expired (database time) and advances the key's durable counter in
   the same row, which is the fencing token (``RETURNING token``); nothing
   returned: taken, sleep 0.5 ms and try again. It is committed on its own, so
   it is a lease every other client sees (as toolguard's), not a row lock held
   by the transaction;
2. ``BEGIN`` + ``expert.ENTER`` (fence check and advance, the intent row, the
   recorded result of a replay), one round trip;
3. the tool's ``UPDATE``, its own round trip (as a tool body must be);
4. ``expert.FINISH`` (the result, the chain's next link, the audit row) +
   ``COMMIT`` + the release (an autocommit ``UPDATE`` that expires the lease if
   the owner still holds it, after the commit), one round trip.

Four PostgreSQL round trips per call (toolguard's PostgreSQL-only call makes
five: acquire, enter, tool, finish, release). ``check()`` as ``expert.py``'s.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from typing import Any

from expert import ENTER, FINISH, TABLES, Stale, check_tables, entry_text

LOCK_TABLE = """
CREATE TABLE x_lock (key text PRIMARY KEY, owner text NOT NULL, expires timestamptz NOT NULL,
                     token bigint NOT NULL);
"""
ACQUIRE = """
INSERT INTO x_lock AS l (key, owner, expires, token)
VALUES (%(key)s, %(owner)s, clock_timestamp() + %(ttl)s * interval '1 millisecond', 1)
ON CONFLICT (key) DO UPDATE SET owner = EXCLUDED.owner, expires = EXCLUDED.expires,
                                token = l.token + 1
WHERE l.expires <= clock_timestamp()
RETURNING token
"""
RELEASE = ("UPDATE x_lock SET expires = '-infinity' WHERE key = %(key)s AND owner = %(owner)s "
           "AND expires > clock_timestamp()")
UPDATE = "UPDATE lead SET score = score + %s WHERE id = %s RETURNING score"
TTL_MS = 10_000
SPIN_S = 0.0005


class ExpertPgLocks:
    """The hand-written guarded call, lease and data in one PostgreSQL, on the given pool."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        with pool.connection() as conn:
            conn.execute(TABLES)
            conn.execute(LOCK_TABLE)
        self._count = threading.Lock()
        self.calls = 0

    def call(self, lead: str) -> Any:
        key = f"lead:{lead}"
        lease = {"key": key, "owner": uuid.uuid4().hex, "ttl": TTL_MS}
        with self.pool.connection() as conn:
            while True:
                row = conn.execute(ACQUIRE, lease).fetchone()
                if row is not None:
                    break
                time.sleep(SPIN_S)
            token = row[0]
            args = json.dumps({"lead_id": lead, "delta": 1}, separators=(",", ":"),
                              sort_keys=True)
            intent = uuid.uuid4().hex
            released = False
            try:
                with conn.pipeline() as pipe:
                    conn.execute("BEGIN")
                    entered = conn.execute(ENTER, {"key": key, "token": token, "id": intent})
                    pipe.sync()
                    advanced, fresh, recorded = entered.fetchone()
                    if not advanced:
                        raise Stale(key)
                    if not fresh:  # a replay: the fence advance stands, the result is the answer
                        conn.execute("COMMIT")
                        return recorded
                    updated = conn.execute(UPDATE, (1, lead))
                    pipe.sync()
                    (score,) = updated.fetchone()
                    conn.execute(FINISH, {
                        "result": json.dumps(score), "id": intent, "key": key,
                        "entry": entry_text("scorer", "add_score", key, token, args),
                        "agent": "scorer", "tool": "add_score", "token": token, "args": args})
                    conn.execute("COMMIT")
                    conn.execute(RELEASE, lease)  # after the commit, in the same round trip
                released = True
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            finally:
                if not released:
                    conn.execute(RELEASE, lease)
        with self._count:
            self.calls += 1
        return score

    def check(self) -> list[str]:
        """What does not hold after the run (empty: every guarantee held)."""
        with self.pool.connection() as conn:
            return check_tables(conn, self.calls, args_sql="args::text")
