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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from toolguard.errors import BackendUnavailable
from toolguard.locks.base import Attempt, BackendInfo

__all__ = ["AsyncRedisBackend", "RedisBackend", "redis_keys"]

INFO = BackendInfo(
    name="redis",
    durable_tokens=False,
    server_wakeup=True,
    fair=True,
    note="efficiency-grade without AOF persistence and a single primary; tokens are "
         "re-seeded from the store after data loss",
)

# Grant KEYS[1] (lock) to ARGV[1] if it is free and ARGV[1] is first among live
# waiters; mint the token in the same step. Otherwise queue ARGV[1].
# KEYS: lock, fence, q, qx   ARGV: owner, ttl_ms, presence_ms, counter_ttl_ms
# Returns {token, 0} on grant, {0, retry_ms} when queued.
ACQUIRE = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local owner = ARGV[1]
local holder = redis.call('GET', KEYS[1])
if holder == owner then
  return {tonumber(redis.call('GET', KEYS[2])), 0}
end
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
  if not head or head == owner then
    local token = math.max((tonumber(redis.call('GET', KEYS[2])) or 0) + 1, now_us)
    redis.call('SET', KEYS[1], owner, 'PX', ARGV[2])
    redis.call('SET', KEYS[2], string.format('%.0f', token), 'PX', ARGV[4])
    if head then
      redis.call('ZREM', KEYS[3], owner)
      redis.call('ZREM', KEYS[4], owner)
    end
    return {token, 0}
  end
end
redis.call('ZADD', KEYS[3], 'NX', now_us, owner)
redis.call('ZADD', KEYS[4], now_ms + tonumber(ARGV[3]), owner)
redis.call('PEXPIRE', KEYS[3], ARGV[3] * 2)
redis.call('PEXPIRE', KEYS[4], ARGV[3] * 2)
local left = redis.call('PTTL', KEYS[1])
if left < 0 then left = 0 end
return {0, left}
"""

# Release KEYS[1] if ARGV[1] holds it, and leave the queue either way; hand the
# lock (with a fresh token) to the first live waiter and push the token onto its
# wake-up list (ARGV[2] .. owner). The waiter's TTL travels in its owner id.
# KEYS: lock, fence, q, qx   ARGV: owner, signal prefix, counter_ttl_ms
# Returns 1 if ARGV[1] held the lock, else 0.
RELEASE = """
local owner = ARGV[1]
redis.call('ZREM', KEYS[3], owner)
redis.call('ZREM', KEYS[4], owner)
redis.call('DEL', ARGV[2] .. owner)
if redis.call('GET', KEYS[1]) ~= owner then return 0 end
redis.call('DEL', KEYS[1])
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
while true do
  local head = redis.call('ZRANGE', KEYS[3], 0, 0)[1]
  if not head then break end
  redis.call('ZREM', KEYS[3], head)
  local seen = redis.call('ZSCORE', KEYS[4], head)
  redis.call('ZREM', KEYS[4], head)
  if seen and tonumber(seen) >= now_ms then
    local ttl = string.match(head, ':(%d+)$')
    local token = math.max((tonumber(redis.call('GET', KEYS[2])) or 0) + 1, now_us)
    local text = string.format('%.0f', token)
    redis.call('SET', KEYS[1], head, 'PX', ttl)
    redis.call('SET', KEYS[2], text, 'PX', ARGV[3])
    redis.call('RPUSH', ARGV[2] .. head, text)
    redis.call('PEXPIRE', ARGV[2] .. head, ttl)
    break
  end
end
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


def _escape(key: str) -> str:
    """Keep braces out of the hash tag so every key of one lock lands in one slot."""
    return key.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


def redis_keys(key: str, prefix: str = "tg") -> tuple[list[str], str]:
    """The four script keys of a lock and the prefix of its waiters' wake-up lists."""
    base = f"{prefix}:{{{_escape(key)}}}"
    return [f"{base}:lock", f"{base}:fence", f"{base}:q", f"{base}:qx"], f"{base}:s:"


class _RedisShared:
    info = INFO

    def __init__(self, *, prefix: str = "tg", presence_ms: int = 2_000,
                 counter_ttl_ms: int = 7 * 24 * 3600 * 1000) -> None:
        self.prefix = prefix
        self.presence_ms = presence_ms
        self.counter_ttl_ms = counter_ttl_ms

    def _acquire_args(self, key: str, owner: str, ttl_ms: int) -> tuple[list[str], list[Any]]:
        keys, _ = redis_keys(key, self.prefix)
        return keys, [owner, ttl_ms, self.presence_ms, self.counter_ttl_ms]

    def _release_args(self, key: str, owner: str) -> tuple[list[str], list[Any]]:
        keys, signal = redis_keys(key, self.prefix)
        return keys, [owner, signal, self.counter_ttl_ms]

    def _signal_key(self, key: str, owner: str) -> str:
        return redis_keys(key, self.prefix)[1] + owner

    def _fence_key(self, key: str) -> str:
        return redis_keys(key, self.prefix)[0][1]

    @staticmethod
    def _attempt(reply: list[int]) -> Attempt:
        token, retry_ms = int(reply[0]), int(reply[1])
        return Attempt(token=token) if token > 0 else Attempt(token=None, retry_ms=retry_ms)

    @staticmethod
    def _unavailable(error: RedisError) -> BackendUnavailable:
        return BackendUnavailable(f"redis: {error}")


_TRANSIENT = (RedisConnectionError, RedisTimeoutError, OSError)


class RedisBackend(_RedisShared):
    """Sync Redis backend (redis-py); scripts are registered once and run by SHA."""

    def __init__(self, client: redis.Redis | str = "redis://127.0.0.1:6379/0",
                 **options: Any) -> None:
        super().__init__(**options)
        self.client = redis.Redis.from_url(client) if isinstance(client, str) else client
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)
        self._renew = self.client.register_script(RENEW)
        self._raise_floor = self.client.register_script(RAISE_FLOOR)

    def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        keys, args = self._acquire_args(key, owner, ttl_ms)
        try:
            return self._attempt(self._acquire(keys=keys, args=args))
        except _TRANSIENT as error:
            raise self._unavailable(error) from error

    def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        try:
            reply = self.client.blpop([self._signal_key(key, owner)], timeout=max(timeout_s, 0.001))
        except _TRANSIENT as error:
            raise self._unavailable(error) from error
        return int(reply[1]) if reply else None

    def release(self, key: str, owner: str) -> bool:
        keys, args = self._release_args(key, owner)
        try:
            return bool(self._release(keys=keys, args=args))
        except _TRANSIENT as error:
            raise self._unavailable(error) from error

    def renew(self, held: Sequence[tuple[str, str, int]]) -> list[bool]:
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for key, owner, ttl_ms in held:
                    self._renew(keys=[redis_keys(key, self.prefix)[0][0]], args=[owner, ttl_ms],
                                client=pipe)
                return [bool(result) for result in pipe.execute()]
        except _TRANSIENT as error:
            raise self._unavailable(error) from error

    def raise_floor(self, key: str, token: int) -> None:
        self._raise_floor(keys=[self._fence_key(key)], args=[token, self.counter_ttl_ms])

    def current_token(self, key: str) -> int:
        """The last token granted for ``key`` (0 if the counter is gone)."""
        return int(self.client.get(self._fence_key(key)) or 0)

    def close(self) -> None:
        self.client.close()


class AsyncRedisBackend(_RedisShared):
    """asyncio Redis backend (``redis.asyncio``) running the same scripts."""

    def __init__(self, client: aredis.Redis | str = "redis://127.0.0.1:6379/0",
                 **options: Any) -> None:
        super().__init__(**options)
        self.client = aredis.Redis.from_url(client) if isinstance(client, str) else client
        self._acquire = self.client.register_script(ACQUIRE)
        self._release = self.client.register_script(RELEASE)
        self._raise_floor = self.client.register_script(RAISE_FLOOR)

    async def try_acquire(self, key: str, owner: str, ttl_ms: int) -> Attempt:
        keys, args = self._acquire_args(key, owner, ttl_ms)
        try:
            return self._attempt(await self._acquire(keys=keys, args=args))
        except _TRANSIENT as error:
            raise self._unavailable(error) from error

    async def wait(self, key: str, owner: str, timeout_s: float) -> int | None:
        try:
            reply = await self.client.blpop([self._signal_key(key, owner)],
                                            timeout=max(timeout_s, 0.001))
        except _TRANSIENT as error:
            raise self._unavailable(error) from error
        return int(reply[1]) if reply else None

    async def release(self, key: str, owner: str) -> bool:
        keys, args = self._release_args(key, owner)
        try:
            return bool(await self._release(keys=keys, args=args))
        except _TRANSIENT as error:
            raise self._unavailable(error) from error

    async def raise_floor(self, key: str, token: int) -> None:
        await self._raise_floor(keys=[self._fence_key(key)], args=[token, self.counter_ttl_ms])

    async def aclose(self) -> None:
        await self.client.aclose()
