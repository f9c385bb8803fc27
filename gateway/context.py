"""One request's facts, typed, from the edge down: :class:`RequestContext`.

The ASGI layers fill it in as the request passes them: its id
(``gateway.api.request_ids``), who sends it (``gateway.api.auth``: the API
key), its hold on the key's limits and the headers that say so
(``gateway.tenants``); the batch runner makes one for each line it runs. The
code below reads it through :func:`context_of`. It is the request's one entry
in the ASGI scope: no per-request fact rides in a scope key of its own.

Ownership is by the key's ``id`` (what a request makes is its key's, and a
name added again is a new key); the ``name`` is what people read (usage,
metrics, logs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from shared.api_keys import ANONYMOUS, KeyEntry
from shared.protocol import BANDS, BATCH, INTERACTIVE

# The scope's entry for the request's context.
SCOPE_KEY = "llmgate"
# The header a request asks for a lower band with (``gateway.api.bands``).
BAND_HEADER = b"x-llmgate-band"
RESUMABLE_HEADER = b"x-llmgate-resumable"
LAST_EVENT_ID_HEADER = b"last-event-id"


class Grant(Protocol):
    """A request's hold on its key's limits (``gateway.tenants.limits.Grant``)."""

    # What the request cost in tokens, once known, and of which prompt and
    # completion; settled when it ends.
    tokens: int | None
    usage: tuple[int, int]

    def end(self, status: int | None) -> None: ...


@dataclass(slots=True)
class RequestContext:
    """Who sends a request, under which id, and what it holds of its key's limits."""

    request_id: str = ""
    # The API key it came with; None when no keys are configured.
    key: KeyEntry | None = None
    # A batch job's line (``gateway.batch.runner``): after interactive requests.
    batch: bool = False
    # Its hold on the key's limits, once admitted (``gateway.tenants``), and
    # the ``x-ratelimit-*`` headers its answer carries.
    grant: Grant | None = None
    rate_headers: dict[str, str] = field(default_factory=dict)
    # The ``x-llmgate-band`` header as sent, and the band it asked for (a place
    # in ``protocol.BANDS``; it runs in its key's band if that is lower).
    band_header: str | None = None
    asked_band: int = INTERACTIVE
    # A chat or completion stream's ``x-llmgate-resumable`` and
    # ``Last-Event-ID`` headers, as sent (``gateway.api.resumable``).
    resumable: str | None = None
    last_event_id: str | None = None

    @property
    def key_id(self) -> str:
        """The key's id (``ANONYMOUS`` without keys): what its usage is owned by."""
        return self.key.id if self.key is not None else ANONYMOUS

    @property
    def key_name(self) -> str:
        """The key's name (``ANONYMOUS`` without keys): what usage and metrics show."""
        return self.key.name if self.key is not None else ANONYMOUS

    @property
    def owner(self) -> str | None:
        """Who owns what the request makes (files, batches, responses): its key's
        id, or None without keys (then every caller sees it)."""
        return self.key.id if self.key is not None else None

    @property
    def viewer(self) -> str | None:
        """Whose files, batches, responses and usage it sees: its key's id;
        None (everyone's) for an admin key, or without keys."""
        return self.key.id if self.key is not None and not self.key.admin else None

    @property
    def band(self) -> int:
        """Its priority band (a place in ``protocol.BANDS``): its key's, or the
        lower one it asked for; a batch line's is ``batch``."""
        if self.batch:
            return BATCH
        key_band = BANDS.index(self.key.band) if self.key is not None else INTERACTIVE
        return max(key_band, self.asked_band)

    @property
    def low_priority(self) -> bool:
        """Only slots no other request waits for: the ``batch`` band."""
        return self.band == BATCH


def context_of(scope: Any) -> RequestContext:
    """The request's context, made the first time it is asked for."""
    context: RequestContext | None = scope.get(SCOPE_KEY)
    if context is None:
        context = scope[SCOPE_KEY] = RequestContext()
    return context
