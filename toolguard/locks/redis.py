"""Redis backend: one Lua script per operation, FIFO queue per key, direct hand-off.

Keys of one lock share the hash tag ``{key}`` so every script touches one slot
(Redis Cluster safe)::

    tg:{K}:lock     holder's owner id, PX ttl
    tg:{K}:fence    last token granted, PX counter_ttl (bounded memory)
    tg:{K}:q        waiters in arrival order (zset owner -> arrival us)
    tg:{K}:qx       waiters' presence deadlines (zset owner -> ms); a crashed waiter drops out
    tg:{K}:s:<own>  a waiter's wake-up list: the releaser pushes the new token there

Tokens are hybrid logical clock values: ``max(last + 1, server time in us,
floor)``. The counter key may expire (so memory does not grow with every
resource ever locked) or vanish with a restart, and the next token is still
above every earlier one unless the server clock went backwards by more than the
time since; the store's high-water marks (``raise_floor``) cover that case.

A release hands the lock to the first live waiter for that waiter's hand-off TTL
(carried in its owner id) and pushes the token onto its wake-up list, in the same
script. The wake-up list outlives a wait (the waiter may be stopped, or give up
and queue again): so the acquire script empties it whenever it queues the owner.
A grant still the owner's would have been returned by that very call, so whatever
the list held was a hand-off that is over; a token found there afterwards was
granted after that call. An acquire by the holder itself (a hand-off that raced
with the end of a wait, a retry after a lost reply) grants the lock again from
now, with a fresh token.

What a Redis deployment answers while it fails over, demotes a primary, restarts
or moves a slot (``IN_TRANSITION``: ``UNBLOCKED`` to a blocked waiter, ``READONLY``,
``MASTERDOWN``, ``NOREPLICAS``, ``LOADING``, ``CLUSTERDOWN``, ``TRYAGAIN``, ``MOVED``,
``ASK``, ``NOSCRIPT`` on a new primary) and a lost connection are
``BackendUnavailable``, here and in the Cluster, Sentinel and quota backends
(``typed_error``): the lock manager asks again until the caller's deadline.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, NoReturn

import redis
import redis.asyncio as aredis
from redis.commands.core import Script
from redis.exceptions import (
    AskError,
    ClusterError,
    NoScriptError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:
    from redis.driver_info import DriverInfo
except ImportError:  # an older redis-py: the version goes in lib_version=
    DriverInfo = None  # type: ignore[assignment,misc]

from toolguard.errors import ConfigurationError, ToolGuardError
from toolguard.locks.base import MIN_TTL_MS, Attempt, BackendInfo, check_ms
from toolguard.runtime.connection_errors import definitive, failure, misconfigured

__all__ = ["AsyncRedisBackend", "RedisBackend", "redis_keys"]

INFO = BackendInfo(
    name="redis",
    durable_tokens=False,
    server_wakeup=True,
    fair=True,
    note="efficiency-grade without AOF persistence and a single primary; tokens are "
         "re-seeded from the store after data loss",
)

# Grant KEYS[1] (lock) to ARGV[1] for ARGV[2] ms if it is free and ARGV[1] is first
# among live waiters, or if ARGV[1] holds it already; mint the token in the same step.
# Otherwise queue ARGV[1] and empty its wake-up list KEYS[5].
# KEYS: lock, fence, q, qx, wake-up list   ARGV: owner, ttl_ms, presence_ms, counter_ttl_ms
# Returns the token (> 0) on grant, -retry_ms (<= 0) when queued: one integer,
# the cheapest reply to parse. A free lock with nobody queued costs five calls.
ACQUIRE = """
local owner = ARGV[1]
local state = redis.call('MGET', KEYS[1], KEYS[2])
local holder, last = state[1], tonumber(state[2])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local grant = holder == owner  -- ours already: granted again, from now
if not holder then
  local head = nil
  while true do
    head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
    if not head or head == owner then break end
    local seen = redis.call('ZSCORE', KEYS[4], head)
    if seen and tonumber(seen) >= now_ms then break end
    redis.call('ZREM', KEYS[3], head)
    redis.call('ZREM', KEYS[4], head)
  end
  if head == owner then
    redis.call('ZREM', KEYS[3], owner)
    redis.call('ZREM', KEYS[4], owner)
  end
  grant = not head or head == owner
end
if grant then
  redis.call('SET', KEYS[1], owner, 'PX', ARGV[2])
  local token = math.max((last or 0) + 1, now_us)
  redis.call('SET', KEYS[2], string.format('%.0f', token), 'PX', ARGV[4])
  return token
end
redis.call('DEL', KEYS[5])  -- a token left there is from a hand-off that is over
redis.call('ZADD', KEYS[3], 'NX', now_us, owner)
redis.call('ZADD', KEYS[4], now_ms + tonumber(ARGV[3]), owner)
redis.call('PEXPIRE', KEYS[3], ARGV[3] * 2)
redis.call('PEXPIRE', KEYS[4], ARGV[3] * 2)
local left = redis.call('PTTL', KEYS[1])
if left < 0 then left = 0 end
return -left
"""

# Release KEYS[1] if ARGV[1] holds it, else leave the queue; hand the lock (with
# a fresh token) to the first live waiter, for the hand-off TTL in its owner id
# ("hex:handoff:ttl", or "hex:ttl"), and push the token onto its wake-up list
# (ARGV[2] .. owner).
# A holder is never queued (every grant dequeues it), so the holder's path skips
# the queue clean-up: three calls when nobody waits. It leaves its own wake-up
# list alone too: a token there (a hand-off it took by asking again) expires with
# that hand-off's TTL, and ACQUIRE empties the list before the owner queues again.
# KEYS: lock, fence, q, qx   ARGV: owner, signal prefix, counter_ttl_ms
# Returns 1 if ARGV[1] held the lock, else 0.
RELEASE = """
local owner = ARGV[1]
if redis.call('GET', KEYS[1]) ~= owner then
  redis.call('DEL', ARGV[2] .. owner)  -- a late hand-off's token, or an empty list
  redis.call('ZREM', KEYS[3], owner)
  redis.call('ZREM', KEYS[4], owner)
  return 0
end
local now_ms, now_us
while true do
  local head = redis.call('ZPOPMIN', KEYS[3])[1]
  if not head then break end
  if not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  end
  local seen = redis.call('ZSCORE', KEYS[4], head)
  redis.call('ZREM', KEYS[4], head)
  if head ~= owner and seen and tonumber(seen) >= now_ms then
    local ttl = string.match(head, ':(%d+):%d+$') or string.match(head, ':(%d+)$')
    local token = math.max((tonumber(redis.call('GET', KEYS[2])) or 0) + 1, now_us)
    local text = string.format('%.0f', token)
    redis.call('SET', KEYS[1], head, 'PX', ttl)
    redis.call('SET', KEYS[2], text, 'PX', ARGV[3])
    redis.call('RPUSH', ARGV[2] .. head, text)
    redis.call('PEXPIRE', ARGV[2] .. head, ttl)
    return 1
  end
end
redis.call('DEL', KEYS[1])
return 1
"""

# Extend KEYS[1] to ARGV[2] ms if ARGV[1] still holds it. Returns 1 or 0.
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

# Make every later token of KEYS[1] (fence) greater than ARGV[1]. Returns the counter.
RAISE_FLOOR = """
local current = tonumber(redis.call('GET', KEYS[1])) or 0
if current < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return tonumber(ARGV[1])
end
return current
"""


DEFAULT_PREFIX = "tg"
DEFAULT_PRESENCE_MS = 2_000
DEFAULT_COUNTER_TTL_MS = 7 * 24 * 3600 * 1000


# --- what a client error means ------------------------------------------------------------

#: Error codes a Redis deployment answers with while it fails over, demotes a primary (a
#: planned ``CLUSTER FAILOVER``, Sentinel reconfiguring it), restarts or moves a slot. The
#: step did not run; the primary that takes over (or this one, back) may run it.
#: ``NOSCRIPT`` reaches the caller only when it comes again right after the script was
#: loaded: the load went to the primaries the client knew, and the slot has moved on.
IN_TRANSITION = frozenset({"UNBLOCKED", "LOADING", "MASTERDOWN", "READONLY", "NOREPLICAS",
                           "CLUSTERDOWN", "TRYAGAIN", "MOVED", "ASK", "NOSCRIPT"})

#: The same answers where redis-py gives the code a class of its own (whose text lacks the
#: code), a lost or timed-out connection (``LOADING`` is one to redis-py), and a Cluster
#: client's own "no node reachable / slot not covered / too many redirections".
_IN_TRANSITION_TYPES = (RedisConnectionError, RedisTimeoutError, OSError, ReadOnlyError,
                        ClusterError, TryAgainError, AskError, NoScriptError,
                        RedisClusterException)

#: Everything a redis-py call may raise for a reason outside the caller's code.
CLIENT_ERRORS = (RedisError, RedisClusterException, OSError)


def error_code(error: BaseException) -> str | None:
    """The Redis error code of a server's answer (``READONLY``, ...), if ``error`` is one."""
    if not isinstance(error, RedisError):
        return None
    code = getattr(error, "status_code", None)
    if code:
        return str(code)
    first = str(error).split(" ", 1)[0]
    return first if first.isupper() else None


def in_transition(error: BaseException) -> bool:
    """True if ``error`` is a lost connection or an answer of a deployment in transition."""
    return isinstance(error, _IN_TRANSITION_TYPES) or error_code(error) in IN_TRANSITION


def typed_error(error: BaseException, backend: str) -> ToolGuardError | None:
    """toolguard's error for what a Redis client raised, or None (re-raise it as it is).

    A lost connection or an answer of a deployment in transition is ``BackendUnavailable``,
    which the lock manager retries until the caller's deadline; a setup mistake (a wrong
    password, a database index past ``databases``) is ``ConfigurationError``. Any other
    answer (a script error, ``WRONGTYPE``) is a bug to see as it is.
    """
    if in_transition(error):
        return failure(backend, error)
    why = definitive(error)
    if why is not None:
        return misconfigured(backend, "", error, why)
    return None


def raise_typed(error: BaseException, backend: str) -> NoReturn:
    """Raise ``typed_error(error, backend)`` from ``error``, or ``error`` itself if None.

    Called in an ``except CLIENT_ERRORS`` clause, so the path that succeeds pays nothing.
    """
    typed = typed_error(error, backend)
    if typed is None:
        raise error
    raise typed from error


def _escape(key: str) -> str:
    """Keep braces out of the hash tag so every key of one lock lands in one slot."""
    if "%" in key or "{" in key or "}" in key:
        return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")
    return key


def _base(key: str, prefix: str) -> str:
    return f"{prefix}:{{{_escape(key)}}}"


def redis_keys(key: str, prefix: str = "tg") -> tuple[list[str], str]:
    """The four script keys of a lock and the prefix of its waiters' wake-up lists."""
    base = _base(key, prefix)
    return [f"{base}:lock", f"{base}:fence", f"{base}:q", f"{base}:qx"], f"{base}:s:"


class _RedisShared:
    """Key names and arguments, shared by the sync and asyncio backends.

    The hot paths build the ``EVALSHA`` command themselves (one flat argument
    tuple, constant arguments pre-encoded) instead of going through redis-py's
    ``Script`` objects: on a round trip of ~70 us the client-side cost shows.
    ``NOSCRIPT`` (a flushed or restarted server) reloads the script and retries.
    """

    info = INFO
    #: What error messages call the server.
    failure_label = "redis"

    def __init__(self, *, prefix: str = DEFAULT_PREFIX, presence_ms: int = DEFAULT_PRESENCE_MS,
                 counter_ttl_ms: int = DEFAULT_COUNTER_TTL_MS) -> None:
        if not isinstance(prefix, str) or not prefix:
            msg = f"prefix must be a non-empty string, got {prefix!r}"
            raise ConfigurationError(msg)
        self.prefix = prefix
        self.presence_ms = check_ms("presence_ms", presence_ms, MIN_TTL_MS)
        self.counter_ttl_ms = check_ms("counter_ttl_ms", counter_ttl_ms, 1)
        self._presence_arg = b"%d" % presence_ms
        self._counter_ttl_arg = b"%d" % counter_ttl_ms
        self._max_block_s: float | None = None  # set from the client's socket timeout

    # Arguments go out as bytes, encoded once: redis-py would encode each one again.

    def _acquire_command(self, sha: str, key: str, owner: str, ttl_ms: int) -> tuple[Any, ...]:
        base = _base(key, self.prefix).encode()
        name = owner.encode()
        return ("EVALSHA", sha, b"5", base + b":lock", base + b":fence", base + b":q", base + b":qx",
                base + b":s:" + name, name, b"%d" % ttl_ms, self._presence_arg,
                self._counter_ttl_arg)

    def _release_command(self, sha: str, key: str, owner: str) -> tuple[Any, ...]:
        base = _base(key, self.prefix).encode()
        return ("EVALSHA", sha, b"4", base + b":lock", base + b":fence", base + b":q", base + b":qx",
                owner.encode(), base + b":s:", self._counter_ttl_arg)

    def _block_s(self, timeout_s: float) -> float:
        """BLPOP's timeout: returning early is a spurious wake-up, the caller looks again."""
        block = max(timeout_s, 0.001)
        return min(block, self._max_block_s) if self._max_block_s else block

    def _signal_key(self, key: str, owner: str) -> str:
        return f"{_base(key, self.prefix)}:s:{owner}"

    def _fence_key(self, key: str) -> str:
        return f"{_base(key, self.prefix)}:fence"

    @staticmethod
    def _attempt(reply: int) -> Attempt:
        token = int(reply)
        return Attempt(token=token) if token > 0 else Attempt(token=None, retry_ms=-token)


#: A call on a server that stopped answering (a stalled link, a frozen server) fails
#: after this long instead of blocking for as long as the stall lasts: release never
#: hangs, acquire's deadline holds. Applies to clients built from a URL; the URL's own
#: ``?socket_timeout=`` wins. A blocking wait (BLPOP) is capped below it.
SOCKET_TIMEOUT_S = 5.0


def version_options() -> dict[str, Any]:
    """redis-py's version, given to every connection toolguard builds: without it redis-py
    looks itself up in the installed distributions (a scan of ``sys.path``) for each new
    connection, which blocks the event loop of an asyncio client."""
    if DriverInfo is None:
        return {"lib_version": redis.__version__}
    return {"driver_info": DriverInfo(lib_version=redis.__version__)}


def client_options() -> dict[str, Any]:
    """Keyword arguments for a redis-py client toolguard builds from a URL."""
    return {"socket_timeout": SOCKET_TIMEOUT_S, "socket_connect_timeout": SOCKET_TIMEOUT_S,
            **version_options()}


def _client_from_url(factory: Any, url: str) -> Any:
    return factory.from_url(url, **client_options())


def _block_cap(client: Any) -> float | None:
    """The longest BLPOP that cannot trip the client's own socket timeout."""
    timeout = client.connection_pool.connection_kwargs.get("socket_timeout")
    return max(0.001, float(timeout) / 2) if timeout else None


def _direct_pool(client: Any) -> Any:
    """The client's pool if the hot path may borrow connections from it directly, else None.

    Only a plain, unbounded ``ConnectionPool`` of a client without a dedicated
    connection: connections kept idle by the backend cannot starve a bounded
    pool's other users. Sentinel, Cluster and bounded pools take the usual path.
    """
    pool = getattr(client, "connection_pool", None)
    if getattr(client, "connection", None) is not None or type(pool) is not redis.ConnectionPool:
        return None
    if pool.max_connections < 2**31:
        return None
    return pool


class RedisBackend(_RedisShared):
    """Sync Redis backend (redis-py); scripts are registered once and run by SHA.

    The hot path (``try_acquire``, ``release``, ``wait``) sends its one command on a
    connection of the backend's own idle list, borrowed from the client's pool
    once, with the connection's retry policy: redis-py's per-command bookkeeping
    (pool state, observability, events) costs more client CPU than the command's
    round trip. A connection that raised anything is disconnected before it is
    used again, so it never carries an unread reply into the next call.
    """

    def __init__(self, client: redis.Redis | str = "redis://127.0.0.1:6379/0", *,
                 prefix: str = DEFAULT_PREFIX, presence_ms: int = DEFAULT_PRESENCE_MS,
                 counter_ttl_ms: int = DEFAULT_COUNTER_TTL_MS) -> None:
        super().__init__(prefix=prefix, presence_ms=presence_ms, counter_ttl_ms=counter_ttl_ms)
        self.client = _client_from_url(redis.Redis, client) if isinstance(client, str) else client
        self._max_block_s = _block_cap(self.client)
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)
        self._renew = self.client.register_script(RENEW)
        self._raise_floor = self.client.register_script(RAISE_FLOOR)
        self._pool = _direct_pool(self.client)
        self._idle: list[Any] = []
        self._pid = os.getpid()

    def _command(self, command: tuple[Any, ...]) -> Any:
        """Send ``command``, return the raw reply (no response callback applied)."""
        pool = self._pool
        if pool is None:
            return self.client.execute_command(*command)
        idle = self._idle
        if self._pid != os.getpid():  # forked: the parent's sockets are not ours
            idle.clear()
            self._pid = os.getpid()
        try:
            conn = idle.pop()
        except IndexError:
            conn = pool.get_connection()
        try:
            reply = conn.retry.call_with_retry(lambda: self._send(conn, command),
                                               lambda _error: conn.disconnect())
        except ResponseError as error:  # the server's answer, read whole: the connection is clean
            if in_transition(error):
                # but a demoted server closes it after UNBLOCKED, and a new connection may
                # reach the new primary (an address that follows it, a Sentinel's answer)
                conn.disconnect()
            idle.append(conn)
            raise
        except BaseException:
            conn.disconnect()
            idle.append(conn)
            raise
        idle.append(conn)
        return reply

    @staticmethod
    def _send(conn: Any, command: tuple[Any, ...]) -> Any:
        conn.send_packed_command(conn.pack_command(*command), check_health=True)
        return conn.read_response()

    def _evalsha(self, script: Script, command: tuple[Any, ...]) -> Any:
        try:
            return self._command(command)
        except NoScriptError:
            self.client.script_load(script.script)
            return self._command(command)

    def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        command = self._acquire_command(self._acquire.sha, key, owner, ttl_ms)
        try:
            return self._attempt(self._evalsha(self._acquire, command))
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)

    def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        try:
            reply = self._command(("BLPOP", self._signal_key(key, owner),
                                   self._block_s(timeout_s)))
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)
        return int(reply[1]) if reply else None

    def release(self, key: str, owner: str) -> bool:
        command = self._release_command(self._release.sha, key, owner)
        try:
            return bool(self._evalsha(self._release, command))
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)

    def renew(self, held: Sequence[tuple[str, str, int]]) -> list[bool]:
        """One pipelined round trip of single-key scripts (Cluster safe).

        Not through ``Script`` objects: a pipeline holding them first asks
        ``SCRIPT EXISTS``, a second round trip on every renewal.
        """
        try:
            results = self._renew_once(held)
            if any(isinstance(result, NoScriptError) for result in results):
                self.client.script_load(RENEW)
                results = self._renew_once(held)
            for result in results:
                if isinstance(result, Exception):
                    raise result
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)
        return [bool(result) for result in results]

    def _renew_once(self, held: Sequence[tuple[str, str, int]]) -> list[Any]:
        with self.client.pipeline(transaction=False) as pipe:
            for key, owner, ttl_ms in held:
                pipe.execute_command("EVALSHA", self._renew.sha, 1, f"{_base(key, self.prefix)}:lock",
                                     owner, ttl_ms)
            return pipe.execute(raise_on_error=False)

    def raise_floor(self, key: str, token: int) -> None:
        try:
            self._raise_floor(keys=[self._fence_key(key)], args=[token, self.counter_ttl_ms])
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)

    def current_token(self, key: str) -> int:
        """The last token granted for ``key`` (0 if the counter is gone)."""
        try:
            # redis-py types a sync client's replies as "Awaitable[Any] | Any"
            return int(self.client.get(self._fence_key(key)) or 0)  # type: ignore[arg-type]
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)

    def close(self) -> None:
        idle, self._idle = self._idle, []
        if self._pool is not None and self._pid == os.getpid():
            for conn in idle:  # back to the pool, which the client's close disconnects
                self._pool.release(conn)
        self.client.close()


class AsyncRedisBackend(_RedisShared):
    """asyncio Redis backend (``redis.asyncio``) running the same scripts."""

    def __init__(self, client: aredis.Redis | str = "redis://127.0.0.1:6379/0", *,
                 prefix: str = DEFAULT_PREFIX, presence_ms: int = DEFAULT_PRESENCE_MS,
                 counter_ttl_ms: int = DEFAULT_COUNTER_TTL_MS) -> None:
        super().__init__(prefix=prefix, presence_ms=presence_ms, counter_ttl_ms=counter_ttl_ms)
        self.client = _client_from_url(aredis.Redis, client) if isinstance(client, str) else client
        self._max_block_s = _block_cap(self.client)
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)
        self._raise_floor = self.client.register_script(RAISE_FLOOR)

    async def _evalsha(self, script: Any, command: tuple[Any, ...]) -> Any:
        try:
            return await self.client.execute_command(*command)
        except NoScriptError:
            await self.client.script_load(script.script)
            return await self.client.execute_command(*command)

    async def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        command = self._acquire_command(self._acquire.sha, key, owner, ttl_ms)
        try:
            return self._attempt(await self._evalsha(self._acquire, command))
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)

    async def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        try:
            reply = await self.client.execute_command("BLPOP", self._signal_key(key, owner),
                                                      self._block_s(timeout_s))
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)
        return int(reply[1]) if reply else None

    async def release(self, key: str, owner: str) -> bool:
        command = self._release_command(self._release.sha, key, owner)
        try:
            return bool(await self._evalsha(self._release, command))
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)

    async def raise_floor(self, key: str, token: int) -> None:
        try:
            await self._raise_floor(keys=[self._fence_key(key)], args=[token, self.counter_ttl_ms])
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)

    async def aclose(self) -> None:
        await self.client.aclose()
