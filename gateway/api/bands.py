"""The band a request asks for: the ``x-llmgate-band`` header, or OpenAI's ``service_tier``.

A request may ask for a lower band (``shared.protocol.BANDS``) than its
API key's, never a higher one: asking higher leaves it in its key's
(``gateway.context.RequestContext.band`` takes the lower of the two). Of
``service_tier``, ``flex`` is the ``batch`` band and ``auto``, ``default``,
``scale`` and ``priority`` keep the key's. A value that is neither is a 400.
"""

from __future__ import annotations

from typing import Any

from gateway import errors
from shared.protocol import BANDS, BATCH, INTERACTIVE

# OpenAI's service tiers, and the band each asks for (INTERACTIVE: the key's).
SERVICE_TIERS = {
    "auto": INTERACTIVE,
    "default": INTERACTIVE,
    "scale": INTERACTIVE,
    "priority": INTERACTIVE,
    "flex": BATCH,
}


def asked_band(header: str | None, raw: dict[str, Any]) -> int:
    """The band the request asks for (its place in ``BANDS``): the header's,
    else its ``service_tier``'s; ``INTERACTIVE`` when it asks for none."""
    if header is not None:
        name = header.strip().lower()
        if name not in BANDS:
            raise errors.BadRequest(
                f"x-llmgate-band must be one of {', '.join(BANDS)}, not {header!r}.",
                "x-llmgate-band",
            )
        return BANDS.index(name)
    tier = raw.get("service_tier")
    if tier is None:
        return INTERACTIVE
    if not isinstance(tier, str) or tier not in SERVICE_TIERS:
        raise errors.BadRequest(
            f"service_tier must be one of {', '.join(SERVICE_TIERS)}, not {tier!r}.",
            "service_tier",
        )
    return SERVICE_TIERS[tier]
