"""What an expert writes by hand to get a guarded call's guarantees, with the same servers.

The reference ``benchmarks/guard.py`` holds toolguard to: a fenced lock, a fence
check and advance in the database, an idempotency record with the recorded
result, a hash-chained audit row, in one transaction, with minimal round trips.

* Redis: one Lua script takes the lock (``SET key owner NX PX ttl``) and
  ``INCR``s the key's counter, which is the fencing token; the release is a
  compare-and-delete script. Both by ``EVALSHA``.
* PostgreSQL, on a pooled autocommit connection in pipeline mode (statements
  prepared by psycopg after their first uses):

  1. ``BEGIN`` + one statement that advances the key's fence row only if the
     token is not below the stored one, inserts the intent row ``ON CONFLICT DO
     NOTHING`` and returns the stored result when it already exists (a replay);
  2. the tool's ``UPDATE`` (in ``d2`` its own round trip, as a tool body must be;
     in ``d`` sent with step 3);
  3. one statement that stores the result in the intent row, advances the key's
     sha256 audit chain (its head kept in the fence row) and inserts the audit
     row (agent, tool, key, token, decision, arguments as JSON, time, hash),
     then ``COMMIT``.

``check()`` proves the run kept the guarantees: one intent and one audit row per
call, every chain recomputes from its rows.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

#: Lock and counter in one script: the token comes with the grant.
ACQUIRE = ("if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then "
           "return redis.call('INCR', KEYS[2]) end return 0")
RELEASE = ("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
           "end return 0")

TABLES = """
CREATE TABLE x_fence (key text PRIMARY KEY, token bigint NOT NULL,
                      chain bytea NOT NULL DEFAULT '\\x'::bytea);
CREATE TABLE x_intent (id text PRIMARY KEY, key text NOT NULL, token bigint NOT NULL,
                       result jsonb);
CREATE TABLE x_audit (seq bigserial PRIMARY KEY, agent text NOT NULL, tool text NOT NULL,
                      key text NOT NULL, token bigint NOT NULL, decision text NOT NULL,
                      args jsonb NOT NULL, at timestamptz NOT NULL DEFAULT now(),
                      hash bytea NOT NULL);
"""

#: Fence check + advance and the intent row; the stored result when it is a replay.
ENTER = """
WITH fence AS (
  INSERT INTO x_fence AS f (key, token) VALUES (%(key)s, %(token)s)
  ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token WHERE f.token <= EXCLUDED.token
  RETURNING 1),
intent AS (
  INSERT INTO x_intent (id, key, token) SELECT %(id)s, %(key)s, %(token)s
  WHERE EXISTS (SELECT 1 FROM fence) ON CONFLICT (id) DO NOTHING RETURNING 1)
SELECT EXISTS (SELECT 1 FROM fence), EXISTS (SELECT 1 FROM intent),
       (SELECT result FROM x_intent WHERE id = %(id)s)
"""

#: The result, the chain's next link, the audit row.
FINISH = """
WITH stored AS (UPDATE x_intent SET result = %(result)s::jsonb WHERE id = %(id)s),
link AS (UPDATE x_fence SET chain = sha256(chain || convert_to(%(entry)s, 'UTF8'))
         WHERE key = %(key)s RETURNING chain)
INSERT INTO x_audit (agent, tool, key, token, decision, args, hash)
SELECT %(agent)s, %(tool)s, %(key)s, %(token)s, 'accepted', %(args)s::jsonb, chain FROM link
"""

UPDATE = "UPDATE lead SET score = score + %s WHERE id = %s RETURNING score"
TTL_MS = 10_000


class Stale(Exception):
    """The fence refused the token: a newer holder wrote meanwhile."""


def entry_text(agent: str, tool: str, key: str, token: int, args: str) -> str:
    """What one audit row's link hashes."""
    return f"{agent}|{tool}|{key}|{token}|accepted|{args}"


class Expert:
    """The hand-written guarded call, on the benchmark's pool and Redis client."""

    def __init__(self, pool: Any, redis: Any, prefix: str) -> None:
        self.pool = pool
        self.redis = redis
        self.prefix = prefix
        self.acquire_sha = redis.script_load(ACQUIRE)
        self.release_sha = redis.script_load(RELEASE)
        with pool.connection() as conn:
            conn.execute(TABLES)
        self.calls = 0

    def d(self, lead: str) -> None:
        self._call(lead, tool_alone=False)

    def d2(self, lead: str) -> None:
        self._call(lead, tool_alone=True)

    def _call(self, lead: str, *, tool_alone: bool) -> None:
        key = f"lead:{lead}"
        lock, counter = f"{self.prefix}lock:{key}", f"{self.prefix}token:{key}"
        owner = uuid.uuid4().hex
        while True:
            token = int(self.redis.evalsha(self.acquire_sha, 2, lock, counter, owner, TTL_MS))
            if token:
                break
        try:
            self._transaction(lead, key, token, uuid.uuid4().hex, tool_alone=tool_alone)
        finally:
            self.redis.evalsha(self.release_sha, 1, lock, owner)

    def _transaction(self, lead: str, key: str, token: int, intent: str, *,
                     tool_alone: bool) -> Any:
        args = json.dumps({"lead_id": lead, "delta": 1}, separators=(",", ":"), sort_keys=True)
        with self.pool.connection() as conn:
            try:
                with conn.pipeline() as pipe:
                    conn.execute("BEGIN")
                    entered = conn.execute(ENTER, {"key": key, "token": token, "id": intent})
                    if not tool_alone:
                        updated = conn.execute(UPDATE, (1, lead))
                    pipe.sync()
                    advanced, fresh, recorded = entered.fetchone()
                    if not advanced:
                        raise Stale(key)
                    if not fresh:  # a replay: the recorded result is the answer
                        conn.execute("ROLLBACK")
                        return recorded
                    if tool_alone:
                        pipe.sync()
                        updated = conn.execute(UPDATE, (1, lead))
                        pipe.sync()
                    (score,) = updated.fetchone()
                    conn.execute(FINISH, {
                        "result": json.dumps(score), "id": intent, "key": key,
                        "entry": entry_text("scorer", "add_score", key, token, args),
                        "agent": "scorer", "tool": "add_score", "token": token, "args": args})
                    conn.execute("COMMIT")
                self.calls += 1
                return score
            except BaseException:
                conn.execute("ROLLBACK")
                raise

    def check(self) -> list[str]:
        """What does not hold after the run (empty: every guarantee held)."""
        with self.pool.connection() as conn:
            return check_tables(conn, self.calls, args_sql="args::text")


def canonical(args: str) -> str:
    """An audit row's arguments as the link hashed them (jsonb reorders and respaces)."""
    return json.dumps(json.loads(args), separators=(",", ":"), sort_keys=True)


def check_tables(conn: Any, calls: int, *, args_sql: str = "args") -> list[str]:
    """What does not hold in the ``x_*`` tables after ``calls`` calls (empty: every guarantee
    held): one intent with its result and one audit row per call, every link and every
    chain head recomputes. ``conn``: any DB-API connection whose ``execute`` returns a
    cursor (psycopg, sqlite3); ``args_sql``: the audit arguments as text."""
    problems = []
    intents, results = conn.execute("SELECT count(*), count(result) FROM x_intent").fetchone()
    (audits,) = conn.execute("SELECT count(*) FROM x_audit").fetchone()
    if not intents == results == audits == calls:
        problems.append(f"{calls} calls, {intents} intents ({results} with a result), "
                        f"{audits} audit rows")
    heads = dict(conn.execute("SELECT key, chain FROM x_fence").fetchall())
    chains: dict[str, bytes] = {}
    for key, agent, tool, token, args, stored in conn.execute(
            f"SELECT key, agent, tool, token, {args_sql}, hash FROM x_audit ORDER BY seq"):
        link = hashlib.sha256(chains.get(key, b"") + entry_text(
            agent, tool, key, token, canonical(args)).encode())
        chains[key] = link.digest()
        if chains[key] != bytes(stored):
            problems.append(f"{key}: a link does not recompute")
            break
    broken = [k for k, head in chains.items() if bytes(heads[k]) != head]
    if broken:
        problems.append(f"{len(broken)} chain heads do not recompute")
    return problems
