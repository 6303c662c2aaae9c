"""Quotas on Redis: one Lua script per step, every quota of a call in one atomic script.

Per scope two keys, both under one hash tag (``{tgq}``), so one script can
touch every counter of a call on a Redis Cluster too (quota state then lives
on one slot: it is small, and atomic admission across counters needs it)::

    {tgq}:<scope>:z    entries by expiry (zset entry -> expiry ms, server clock)
    {tgq}:<scope>:h    entry -> amount (absent: 1), and '~used' -> the live sum

Both keys expire with their newest entry, so idle scopes cost no memory.
Amounts are doubles: give budgets in integer units (cents) for exact sums.

A server that lost its data (restarted without persistence, flushed) would
count from zero: up to a whole extra budget per window. So the first admission
on a server writes an epoch (``{tgq}:~epoch``, no expiry), each client
remembers the one it saw, and an admission that finds another epoch than its
client saw records the loss (``{tgq}:~lost``). From then on a charge is
refused (``BackendUnavailable``) until its window (or lease) has passed since
the loss: every entry the server forgot would have expired by then, so the
counts are exact again. A process that first talks to the server after the
loss, before any older one does, cannot tell: the loss is caught by the first
older client's admission.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import redis
import redis.asyncio as aredis
from redis.exceptions import NoScriptError

from toolguard.controls.quotas.base import Admitted, Entry, Refused, Verdict, check_charges
from toolguard.controls.quotas.charges import Charge
from toolguard.errors import BackendUnavailable, ConfigurationError
from toolguard.locks.redis import CLIENT_ERRORS, client_options, raise_typed

__all__ = ["AsyncRedisQuotas", "RedisQuotas"]

# Admit every charge or none. KEYS[2i-1], KEYS[2i]: charge i's zset and hash; the last two
# KEYS: the epoch and the loss record. ARGV[4i-3 .. 4i]: charge i's limit, cost, ttl_ms, entry
# id; the last ARGV: the epoch the client saw ('' for none yet).
# Returns {0, epoch, fresh_1 .. fresh_n} (1: counted now, 0: counted before), {i, epoch,
# retry_ms} for the first charge that does not fit (retry_ms -1: its cost alone is over the
# limit), or {-1, epoch, wait_ms} while the server's counts since a loss of its data are short.
ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ek, lk = KEYS[#KEYS - 1], KEYS[#KEYS]
local seen = ARGV[#ARGV]
local epoch = redis.call('GET', ek)
if not epoch then
  epoch = t[1] .. '.' .. t[2]
  redis.call('SET', ek, epoch)
end
if seen ~= '' and seen ~= epoch and redis.call('HGET', lk, 'epoch') ~= epoch then
  redis.call('HSET', lk, 'epoch', epoch, 'at', now)  -- the data this client counted on is gone
end
local n = (#KEYS - 2) / 2
local lost_at = tonumber(redis.call('HGET', lk, 'at'))
if lost_at then
  local wait = 0
  for i = 1, n do
    local left = lost_at + tonumber(ARGV[4 * i - 1]) - now
    if left > wait then wait = left end
  end
  if wait > 0 then return {-1, epoch, wait} end
end
local used, fresh = {}, {}
for i = 1, n do
  local z, h = KEYS[2 * i - 1], KEYS[2 * i]
  local limit, cost, entry = tonumber(ARGV[4 * i - 3]), tonumber(ARGV[4 * i - 2]), ARGV[4 * i]
  local u = tonumber(redis.call('HGET', h, '~used')) or 0
  local gone = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  if #gone > 0 then
    for s = 1, #gone, 1000 do
      local chunk = {unpack(gone, s, math.min(s + 999, #gone))}
      local amounts = redis.call('HMGET', h, unpack(chunk))
      for j = 1, #chunk do u = u - (tonumber(amounts[j]) or 1) end
      redis.call('ZREM', z, unpack(chunk))
      redis.call('HDEL', h, unpack(chunk))
    end
    if u < 1e-9 then u = 0 end
    redis.call('HSET', h, '~used', string.format('%.17g', u))
  end
  if redis.call('ZSCORE', z, entry) then
    fresh[i] = 0
  else
    if u + cost > limit then
      if cost > limit then return {i, epoch, -1} end
      -- walk the live entries, soonest to expire first, until enough would be freed
      local need, freed, start, retry = u + cost - limit, 0, 0, nil
      while not retry do
        local batch = redis.call('ZRANGE', z, start, start + 99, 'WITHSCORES')
        if #batch == 0 then break end
        for j = 1, #batch, 2 do
          freed = freed + (tonumber(redis.call('HGET', h, batch[j])) or 1)
          if freed >= need - 1e-9 then
            retry = math.max(1, tonumber(batch[j + 1]) - now)
            break
          end
        end
        start = start + 100
      end
      if retry then return {i, epoch, retry} end
      -- the sum was above what is there (a key evicted under memory pressure): repair it
      u = freed
      redis.call('HSET', h, '~used', string.format('%.17g', u))
      if u + cost > limit then return {i, epoch, 1} end
    end
    fresh[i] = 1
  end
  used[i] = u
end
for i = 1, n do
  if fresh[i] == 1 then
    local z, h = KEYS[2 * i - 1], KEYS[2 * i]
    local cost, ttl, entry = tonumber(ARGV[4 * i - 2]), tonumber(ARGV[4 * i - 1]), ARGV[4 * i]
    redis.call('ZADD', z, string.format('%.0f', now + ttl), entry)
    if cost ~= 1 then redis.call('HSET', h, entry, ARGV[4 * i - 2]) end
    redis.call('HSET', h, '~used', string.format('%.17g', used[i] + cost))
    redis.call('PEXPIRE', z, ttl)
    redis.call('PEXPIRE', h, ttl)
  end
end
return {0, epoch, unpack(fresh)}
"""

# Remove entries. KEYS[2i-1], KEYS[2i]: entry i's zset and hash; ARGV[i]: its id.
# Returns how many were there.
RELEASE = """
local removed = 0
for i = 1, #ARGV do
  local z, h = KEYS[2 * i - 1], KEYS[2 * i]
  if redis.call('ZREM', z, ARGV[i]) == 1 then
    local amount = tonumber(redis.call('HGET', h, ARGV[i])) or 1
    redis.call('HDEL', h, ARGV[i])
    local u = (tonumber(redis.call('HGET', h, '~used')) or 0) - amount
    if u < 1e-9 then u = 0 end
    redis.call('HSET', h, '~used', string.format('%.17g', u))
    removed = removed + 1
  end
end
return removed
"""

# Extend live entries to ARGV[1] ms from now. KEYS as RELEASE; ARGV[i + 1]: entry i.
# Returns 1 per entry still live (renewed), 0 per entry gone or expired (the slot is lost).
RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local out = {}
for i = 1, #ARGV - 1 do
  local z, h = KEYS[2 * i - 1], KEYS[2 * i]
  local score = tonumber(redis.call('ZSCORE', z, ARGV[i + 1]))
  if score and score > now then
    redis.call('ZADD', z, 'XX', string.format('%.0f', now + ttl), ARGV[i + 1])
    if redis.call('PTTL', z) < ttl then
      redis.call('PEXPIRE', z, ttl)
      redis.call('PEXPIRE', h, ttl)
    end
    out[i] = 1
  else
    out[i] = 0
  end
end
return out
"""

# The live sum of KEYS[1] (zset) / KEYS[2] (hash), expired entries left out. Read-only.
USAGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local total = 0
for _, entry in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. now, '+inf')) do
  total = total + (tonumber(redis.call('HGET', KEYS[2], entry)) or 1)
end
return string.format('%.17g', total)
"""

_PREFIX = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _number(value: float) -> bytes:
    return repr(float(value)).encode() if value != int(value) else b"%d" % int(value)


class _Shared:
    name = "redis"
    failure_label = "redis (quotas)"

    def __init__(self, prefix: str = "tgq") -> None:
        if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
            msg = (f"a quota prefix is 1 to 64 of A-Za-z0-9_.:- (it is the keys' hash tag, so "
                   f"every counter of a call is on one Cluster slot), got {prefix!r}")
            raise ConfigurationError(msg)
        self.prefix = prefix
        self.epoch = b""  # the server's epoch as this client last saw it (b"": not yet)

    def _keys(self, scope: str) -> tuple[bytes, bytes]:
        base = f"{{{self.prefix}}}:{scope}".encode()
        return base + b":z", base + b":h"

    def _admit_args(self, charges: Sequence[Charge]) -> tuple[list[bytes], list[bytes]]:
        check_charges(charges)
        keys: list[bytes] = []
        args: list[bytes] = []
        for charge in charges:
            keys.extend(self._keys(charge.scope))
            args += [_number(charge.limit), _number(charge.cost), b"%d" % charge.ttl_ms,
                     charge.entry.encode()]
        base = f"{{{self.prefix}}}:".encode()
        keys += [base + b"~epoch", base + b"~lost"]
        args.append(self.epoch)
        return keys, args

    def _entry_keys(self, entries: Sequence[Entry]) -> list[bytes]:
        return [key for scope, _ in entries for key in self._keys(scope)]

    def _verdict(self, reply: Sequence[Any]) -> Verdict:
        head = int(reply[0])
        epoch = reply[1]
        self.epoch = epoch if isinstance(epoch, bytes) else str(epoch).encode()
        if head == 0:
            return Admitted(tuple(bool(int(flag)) for flag in reply[2:]))
        retry = int(reply[2])
        if head < 0:
            msg = (f"redis (quotas) lost its counters (restarted without persistence, or "
                   f"flushed): calls with these quotas are refused for {retry / 1000:.3g}s more, "
                   f"until every window running at the loss has passed")
            raise BackendUnavailable(msg)
        return Refused(head - 1, None if retry < 0 else retry / 1000)


class RedisQuotas(_Shared):
    """Sync Redis quota backend; scripts registered once and run by SHA."""

    def __init__(self, client: redis.Redis | str = "redis://127.0.0.1:6379/0", *,
                 prefix: str = "tgq") -> None:
        super().__init__(prefix)
        self.client = (redis.Redis.from_url(client, **client_options())
                       if isinstance(client, str) else client)
        self._scripts = {name: self.client.register_script(text) for name, text in
                         (("admit", ADMIT), ("release", RELEASE), ("renew", RENEW),
                          ("usage", USAGE))}

    def _run(self, name: str, keys: Sequence[bytes], args: Sequence[bytes]) -> Any:
        script = self._scripts[name]
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        # redis-py leaves execute_command unannotated (here and in the asyncio client)
        try:
            try:
                return self.client.execute_command(*command)  # type: ignore[no-untyped-call]
            except NoScriptError:
                self.client.script_load(script.script)
                return self.client.execute_command(*command)  # type: ignore[no-untyped-call]
        except CLIENT_ERRORS as error:  # a lost connection, a server in a failover, ...
            raise_typed(error, self.failure_label)

    def admit(self, charges: Sequence[Charge]) -> Verdict:
        """Count every charge or none (one script)."""
        keys, args = self._admit_args(charges)
        return self._verdict(self._run("admit", keys, args))

    def release(self, entries: Sequence[Entry]) -> int:
        """Remove entries (a finished call's slots, a refunded budget); returns how many were there."""
        if not entries:
            return 0
        return int(self._run("release", self._entry_keys(entries), [e.encode() for _, e in entries]))

    def renew(self, entries: Sequence[Entry], ttl_ms: int) -> list[bool]:
        """Extend live entries to ``ttl_ms`` from now; False where the entry is gone."""
        if not entries:
            return []
        reply = self._run("renew", self._entry_keys(entries),
                          [b"%d" % ttl_ms, *(e.encode() for _, e in entries)])
        return [bool(int(flag)) for flag in reply]

    def usage(self, scope: str) -> float:
        """The live sum of ``scope`` (calls, running calls or amount)."""
        return float(self._run("usage", self._keys(scope), []))

    def close(self) -> None:
        self.client.close()


class AsyncRedisQuotas(_Shared):
    """asyncio Redis quota backend (``redis.asyncio``), the same scripts."""

    def __init__(self, client: aredis.Redis | str = "redis://127.0.0.1:6379/0", *,
                 prefix: str = "tgq") -> None:
        super().__init__(prefix)
        self.client = (aredis.Redis.from_url(client, **client_options())
                       if isinstance(client, str) else client)
        self._scripts = {name: self.client.register_script(text) for name, text in
                         (("admit", ADMIT), ("release", RELEASE), ("renew", RENEW),
                          ("usage", USAGE))}

    async def _run(self, name: str, keys: Sequence[bytes], args: Sequence[bytes]) -> Any:
        script = self._scripts[name]
        command = ("EVALSHA", script.sha, len(keys), *keys, *args)
        try:
            try:
                return await self.client.execute_command(*command)  # type: ignore[no-untyped-call]
            except NoScriptError:
                await self.client.script_load(script.script)
                return await self.client.execute_command(*command)  # type: ignore[no-untyped-call]
        except CLIENT_ERRORS as error:
            raise_typed(error, self.failure_label)

    async def admit(self, charges: Sequence[Charge]) -> Verdict:
        keys, args = self._admit_args(charges)
        return self._verdict(await self._run("admit", keys, args))

    async def release(self, entries: Sequence[Entry]) -> int:
        if not entries:
            return 0
        return int(await self._run("release", self._entry_keys(entries),
                                   [e.encode() for _, e in entries]))

    async def renew(self, entries: Sequence[Entry], ttl_ms: int) -> list[bool]:
        if not entries:
            return []
        reply = await self._run("renew", self._entry_keys(entries),
                                [b"%d" % ttl_ms, *(e.encode() for _, e in entries)])
        return [bool(int(flag)) for flag in reply]

    async def usage(self, scope: str) -> float:
        return float(await self._run("usage", self._keys(scope), []))

    async def aclose(self) -> None:
        await self.client.aclose()
