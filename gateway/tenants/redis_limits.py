"""The limits store every gateway process and replica shares: Redis (``--limits redis://...``).

:class:`RedisLimits` runs ``gateway.tenants.windows.gcra``'s arithmetic (in
milliseconds) as Lua scripts, one per decision, so checking a key's three
limits and taking them is atomic: two gateways never both take the last unit.
The scripts read Redis's clock (``TIME``), so replicas with skewed clocks still
agree. A running request holds a lease that lapses ``LEASE_SECONDS`` after it
was taken or last renewed, so a killed gateway's slots come back by themselves.
Renewing leases, and counting in memory while Redis is down, is
``gateway.tenants.limits``'s job.
"""

from __future__ import annotations

from typing import Any

from gateway.tenants.windows import (
    CONCURRENT,
    REQUESTS,
    TOKENS,
    TOO_LARGE,
    Decision,
)
from shared.api_keys import KeyEntry

# The keys, per API key id, in one hash slot ({ID}) so a cluster could hold them:
#   llmgate:limits:v1:{ID}:rpm   the requests window's TAT (ms), expires when full
#   llmgate:limits:v1:{ID}:tpm   the tokens window's TAT (ms), expires when full
#   llmgate:limits:v1:{ID}:conc  sorted set: a lease per running request, scored
#                                by when it lapses
PREFIX = "llmgate:limits:v1:"
# Seconds; Redis on the same network answers in well under a millisecond.
TIMEOUT = 0.5
# A gateway renews its running requests' leases every third of this
# (gateway.tenants.limits), so a killed one holds its keys' slots this long at most.
LEASE_SECONDS = 30.0

_REFUSED = {0: "", 1: REQUESTS, 2: TOKENS, 3: CONCURRENT, 4: TOO_LARGE}

_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local WINDOW = 60000
-- A window's TAT, kept until the bucket is full again.
local function put(key, tat)
  redis.call('SET', key, string.format('%.3f', tat), 'PX', math.max(1, math.ceil(tat - now)))
end
"""

# KEYS: rpm, tpm, conc. ARGV: rpm, tpm, max_concurrent, cost, lease, lease ms.
# Returns: refused (0 none, 1 requests, 2 tokens, 3 concurrent, 4 too large),
# wait ms, remaining requests, reset requests ms, remaining tokens, reset tokens ms, in use.
ADMIT = (
    _NOW
    + """
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost = tonumber(ARGV[4])
local function step(key, limit, n)
  if limit <= 0 then return true, 0, 0, 0, 0 end
  local per_unit = WINDOW / limit
  local start = math.max(tonumber(redis.call('GET', key) or '0'), now)
  local new_tat = start + n * per_unit
  local wait = new_tat - now - WINDOW
  local fits = wait <= 0
  local after = start
  if fits then after = new_tat end
  local remaining = math.max(0, math.floor((WINDOW - (after - now)) / per_unit + 1e-9))
  return fits, new_tat, wait, remaining, after - now
end
local r_fits, r_tat, r_wait, r_rem, r_reset = step(KEYS[1], rpm, 1)
local t_fits, t_tat, t_wait, t_rem, t_reset = step(KEYS[2], tpm, cost)
local in_use = 0
if conc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  in_use = redis.call('ZCARD', KEYS[3])
end
local refused = 0
local wait = 0
if tpm > 0 and cost > tpm then
  refused = 4
elseif not r_fits then
  refused = 1
  wait = r_wait
  if not t_fits then wait = math.max(wait, t_wait) end
elseif not t_fits then
  refused = 2
  wait = t_wait
elseif conc > 0 and in_use >= conc then
  refused = 3
end
if refused == 0 then
  if rpm > 0 then
    put(KEYS[1], r_tat)
  end
  if tpm > 0 then
    put(KEYS[2], t_tat)
  end
  if conc > 0 then
    local lease_ms = tonumber(ARGV[6])
    redis.call('ZADD', KEYS[3], now + lease_ms, ARGV[5])
    redis.call('PEXPIRE', KEYS[3], math.ceil(lease_ms))
    in_use = in_use + 1
  end
end
return {refused, math.ceil(wait), r_rem, math.ceil(r_reset), t_rem, math.ceil(t_reset), in_use}
"""
)

# KEYS: tpm. ARGV: tpm, delta tokens (negative: a refund).
SETTLE = (
    _NOW
    + """
local tpm, delta = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), now) + delta * WINDOW / tpm
if tat <= now then
  redis.call('DEL', KEYS[1])
else
  put(KEYS[1], tat)
end
return 0
"""
)

# KEYS: conc. ARGV: lease ms, then the leases to renew (only those still there: XX).
RENEW = (
    _NOW
    + """
local lease_ms = tonumber(ARGV[1])
for i = 2, #ARGV do
  redis.call('ZADD', KEYS[1], 'XX', now + lease_ms, ARGV[i])
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], math.ceil(lease_ms)) end
return 0
"""
)


def key_of(key_id: str, window: str) -> str:
    """A key's window, by its stable id (a name revoked and added again is a
    new key, with windows of its own)."""
    return f"{PREFIX}{{{key_id}}}:{window}"


class RedisLimits:
    def __init__(
        self, url: str, lease_seconds: float = LEASE_SECONDS, timeout: float = TIMEOUT
    ) -> None:
        self.url = url
        self.lease_ms = int(lease_seconds * 1000)
        import redis.asyncio  # here: a gateway without Redis never loads it

        self._client = redis.asyncio.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            # A failed call is reported at once; the Limiter decides when to try again.
            retry_on_timeout=False,
        )
        self._admit = self._client.register_script(ADMIT)
        self._settle = self._client.register_script(SETTLE)
        self._renew = self._client.register_script(RENEW)

    async def admit(self, entry: KeyEntry, cost: int, lease: str) -> Decision:
        keys = [key_of(entry.id, w) for w in ("rpm", "tpm", "conc")]
        args: list[Any] = [
            entry.requests_per_minute,
            entry.tokens_per_minute,
            entry.max_concurrent,
            cost,
            lease,
            self.lease_ms,
        ]
        refused, wait, r_rem, r_reset, t_rem, t_reset, in_use = await self._admit(keys, args)
        kind = _REFUSED[int(refused)]
        retry_after: float | None = 0.0
        if kind == TOO_LARGE:
            retry_after = None
        elif kind == CONCURRENT:
            retry_after = 1.0
        elif kind:
            retry_after = int(wait) / 1000
        return Decision(
            allowed=not kind,
            refused_by=kind,
            retry_after=retry_after,
            remaining_requests=int(r_rem),
            reset_requests=int(r_reset) / 1000,
            remaining_tokens=int(t_rem),
            reset_tokens=int(t_reset) / 1000,
            in_use=int(in_use),
        )

    async def settle(self, entry: KeyEntry, delta: int) -> None:
        if entry.tokens_per_minute and delta:
            await self._settle([key_of(entry.id, "tpm")], [entry.tokens_per_minute, delta])

    async def refund_request(self, entry: KeyEntry) -> None:
        """Give back one request of the key's requests window."""
        if entry.requests_per_minute:
            await self._settle([key_of(entry.id, "rpm")], [entry.requests_per_minute, -1])

    async def release(self, entry: KeyEntry, lease: str) -> None:
        if entry.max_concurrent:
            await self._client.zrem(key_of(entry.id, "conc"), lease)

    async def renew(self, leases: dict[str, list[str]]) -> None:
        """Push back the lapse of ``leases`` (by key id) still held."""
        for name, held in leases.items():
            await self._renew([key_of(name, "conc")], [self.lease_ms, *held])

    async def running(self, key_id: str) -> int:
        """Leases of the key ``key_id`` not yet lapsed (for tests and operators)."""
        return int(await self._client.zcard(key_of(key_id, "conc")))

    @property
    def client(self) -> Any:
        """The Redis client (the key budgets' counters live there too)."""
        return self._client

    async def close(self) -> None:
        await self._client.aclose()
