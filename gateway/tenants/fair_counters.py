"""Fair sharing's counters kept level across every gateway process, in the limits' Redis.

Every ``SYNC_SECONDS`` each process hands Redis, in one script, what it saw
since it last did (per key: service settled, a lift, whether it is active
there) and takes back every process's counters for those keys, the least
counter of the keys active anywhere (where a key that becomes active
starts) and the floor (``gateway.dispatch.fair_share`` does the rest). A key
stays active in Redis ``ACTIVE_SECONDS`` after a process last said so, so a
killed gateway's keys drop out by themselves. While Redis does not answer,
each process goes on with its own counters and tells the rest once it does.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from gateway.dispatch.fair_share import FairShare
from gateway.tenants.spending import RedisHealth

# How often a process exchanges its counters: a key's service reaches the
# other processes this late, against a request's seconds.
SYNC_SECONDS = 0.5
# A key is active anywhere while a process said so this lately (several exchanges).
ACTIVE_SECONDS = 5.0

# One hash slot ({fair}) for a cluster:
#   llmgate:fair:v1:{fair}:served  hash: key id -> virtual tokens of service
#   llmgate:fair:v1:{fair}:active  hash: key id -> when it stops being active (ms)
#   llmgate:fair:v1:{fair}:floor   where a key starts when none is active
PREFIX = "llmgate:fair:v1:{fair}:"

# KEYS: served, active, floor. ARGV: active ms, then per key: id, lift, added, active (0/1).
# Returns: per key told of, its id and counter; the least active counter ('' if
# none); the floor. Numbers as strings (a Lua number would lose its fraction).
SYNC = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
local told = {}
for i = 2, #ARGV, 4 do
  local id, lift, added = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local value = tonumber(redis.call('HGET', KEYS[1], id) or '0')
  if lift > value then value = lift end
  value = value + added
  redis.call('HSET', KEYS[1], id, string.format('%.3f', value))
  if ARGV[i + 3] == '1' then redis.call('HSET', KEYS[2], id, now + ttl) end
  told[#told + 1] = id
  told[#told + 1] = string.format('%.3f', value)
end
local least = nil
local active = redis.call('HGETALL', KEYS[2])
for i = 1, #active, 2 do
  if tonumber(active[i + 1]) < now then
    redis.call('HDEL', KEYS[2], active[i])
  else
    local value = tonumber(redis.call('HGET', KEYS[1], active[i]) or '0')
    if least == nil or value < least then least = value end
  end
end
local floor = tonumber(redis.call('GET', KEYS[3]) or '0')
if least ~= nil and least > floor then
  floor = least
  redis.call('SET', KEYS[3], string.format('%.3f', floor))
end
return {told, least and string.format('%.3f', least) or '', string.format('%.3f', floor)}
"""

log = logging.getLogger(__name__)


class FairCounters:
    """Keeps ``share`` (this process's counters) level with every other process's."""

    def __init__(
        self, share: FairShare, limiter: RedisHealth, client: Any, prefix: str = PREFIX
    ) -> None:
        self.share = share
        share.kept_level = True
        self.limiter = limiter
        self.active_seconds = ACTIVE_SECONDS
        self._sync = client.register_script(SYNC)
        self._keys = [f"{prefix}served", f"{prefix}active", f"{prefix}floor"]
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            await self.exchange()
            await asyncio.sleep(SYNC_SECONDS)

    async def exchange(self) -> None:
        """Tell Redis what this process saw, and take what every process did."""
        if not self.limiter.uses_redis():
            self.share.unshared()
            return
        told = self.share.exchange()
        argv: list[Any] = [int(self.active_seconds * 1000)]
        for tenant, lift, added, active in told:
            argv += [tenant, repr(lift), repr(added), int(active)]
        try:
            reply = await self._sync(keys=self._keys, args=argv)
        except self.limiter.failures as exc:
            self.share.untold(told)
            self.share.unshared()
            self.limiter.redis_failed("fair share", exc)
            return
        self.limiter.redis_answered()
        pairs, least, floor = reply
        served = {_text(pairs[i]): float(pairs[i + 1]) for i in range(0, len(pairs), 2)}
        self.share.absorb(served, float(least) if least not in (b"", "") else None, float(floor))


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
