"""The shared cache backend: Redis (``--cache redis://HOST:PORT/DB``).

Every gateway process and replica pointed at the same Redis shares its
entries; each entry carries its TTL (``SET ... PX``), so Redis expires it
and its own ``maxmemory-policy`` bounds the size. Short socket timeouts: a
slow or absent Redis must cost a request little (``ResponseCache`` then
stops asking for a while).
"""

from __future__ import annotations

import redis.asyncio

# Keys live under one prefix, with the entry format's version, so a new
# format never reads an old one and `redis-cli --scan` finds them.
PREFIX = "llmgate:cache:v1:"
# Seconds; Redis on the same network answers in well under a millisecond.
TIMEOUT = 0.5


class RedisStore:
    def __init__(self, url: str) -> None:
        self.url = url
        self._client = redis.asyncio.Redis.from_url(
            url,
            socket_timeout=TIMEOUT,
            socket_connect_timeout=TIMEOUT,
            # A failed call is reported at once; ResponseCache decides when to retry.
            retry_on_timeout=False,
        )

    async def get(self, key: str) -> bytes | None:
        value = await self._client.get(PREFIX + key)
        # Bytes: the client does not decode responses unless told to.
        return value if isinstance(value, bytes) else None

    async def put(self, key: str, value: bytes, ttl: float) -> None:
        await self._client.set(PREFIX + key, value, px=max(1, int(ttl * 1000)))

    async def close(self) -> None:
        await self._client.aclose()
