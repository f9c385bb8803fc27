"""The Responses API's state, kept by the gateway so any replica can answer.

vLLM's server keeps stored responses in its own process, so behind a pool
``GET /v1/responses/{id}`` and ``previous_response_id`` would work only on
the worker that answered. The gateway keeps them instead: each stored
response (``store`` is true by default, as in OpenAI's API) is saved with
the conversation that led to it (its input items and its output items) in
the state store (``gateway.state``: SQLite shared by one host's gateway
processes, or the ``--state-db`` every replica shares) for
``--responses-days``. ``GET`` answers from there; ``previous_response_id``
becomes that conversation prepended to the new input, which any worker can
run. An id the store does not hold is a 404 here (``not_found``), never a
question to a worker. A store that does not answer: ``previous_response_id``
is a 503; an answer that cannot be stored still goes out (the failure is
logged). With API keys a stored response is its key's (its key's id): to
another key (but an ``admin`` one) its id is unknown, for ``GET``, cancel
and ``previous_response_id`` alike, and a request that names it as its own
id (vLLM's ``request_id``) is refused before it runs (``check_id``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import msgspec

from gateway import errors
from gateway.state import State
from gateway.state.response_store import IdTaken

log = logging.getLogger(__name__)

# vLLM's compact JSON for a response that continues none (patched when it does).
_NO_PREVIOUS = b'"previous_response_id":null'


class Record(msgspec.Struct):
    """One stored response and the conversation items up to and including it."""

    response: dict[str, Any]
    items: list[Any]


__all__ = ["Record", "Recorder", "check_id", "continued", "load", "not_found"]


async def load(store: State, response_id: str, viewer: str | None) -> Record | None:
    """The stored response, or None if this gateway never kept it (or it
    expired, or ``viewer`` may not see it: ``gateway.state``)."""
    value = await store.call(store.responses.get, response_id, viewer)
    if value is None:
        return None
    try:
        return msgspec.json.decode(value, type=Record)
    except msgspec.DecodeError:
        log.warning("dropping an unreadable stored response %s", response_id)
        return None


def not_found(response_id: str) -> errors.NotFound:
    """What vLLM's server (and OpenAI) answer for a response id they do not hold."""
    return errors.NotFound(f"Response with id '{response_id}' not found.", "response_id")


async def check_id(store: State, body: dict[str, Any], owner: str | None) -> None:
    """400 for a request that names as its response's id (vLLM's ``request_id``)
    one that another key's stored response holds: said before the request
    runs, not after (the store refuses it too, the guard against a race)."""
    chosen = body.get("request_id")
    if isinstance(chosen, str) and await store.call(store.responses.taken, chosen, owner):
        raise errors.BadRequest(
            f"`request_id` {chosen!r} is already the id of a stored response; choose another.",
            "request_id",
        )


def input_items(body: dict[str, Any]) -> list[Any]:
    """A request's ``input`` as a list of items (a string is one user message)."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    return list(given) if isinstance(given, list) else []


def continued(body: dict[str, Any], previous: Record) -> dict[str, Any]:
    """``body`` with the conversation of ``previous`` in its input instead of its id."""
    out = {k: v for k, v in body.items() if k != "previous_response_id"}
    out["input"] = [*previous.items, *input_items(body)]
    return out


class Recorder:
    """Reads a Responses answer as it goes out and stores it once it is complete."""

    def __init__(
        self,
        store: State,
        body: dict[str, Any],
        previous: Record | None,
        previous_id: str,
        owner: str | None,
    ) -> None:
        self.store = store
        self.owner = owner
        self.items = [*(previous.items if previous else []), *input_items(body)]
        self.previous_id = previous_id
        self.buffer = b""

    def patch(self, chunk: bytes) -> bytes:
        """The answer names the response it continues (vLLM saw none: it got the items)."""
        if not self.previous_id:
            return chunk
        named = f'"previous_response_id":{json.dumps(self.previous_id)}'.encode()
        return chunk.replace(_NO_PREVIOUS, named)

    async def save(self, response: dict[str, Any]) -> None:
        if response.get("status") not in ("completed", "incomplete") or not response.get("id"):
            return
        record = Record(response, [*self.items, *response.get("output", [])])
        store = self.store
        try:
            await store.call(
                store.responses.put, str(response["id"]), msgspec.json.encode(record), self.owner
            )
        except errors.StateUnavailable as exc:
            log.warning("response %s not stored: %s", response["id"], exc.message)
        except IdTaken:
            # Another key stored this id after check_id looked: theirs stays.
            log.warning("response %s not stored: another key's response has its id", response["id"])

    async def whole(self, content: bytes) -> bytes:
        content = self.patch(content)
        try:
            response = json.loads(content)
        except ValueError:
            return content
        if isinstance(response, dict):
            await self.save(response)
        return content

    async def stream(self, body: AsyncIterable[Any], save: bool = True) -> AsyncIterator[bytes]:
        """The stream (patched), stored before its final event reaches the
        client, so a GET right after it finds the response."""
        try:
            async for part in body:
                chunk = self.patch(bytes(part))
                if not save:
                    yield chunk
                    continue
                self.buffer += chunk
                events, _, self.buffer = self.buffer.rpartition(b"\n\n")
                for line in events.split(b"\n"):
                    if line.startswith(b"data: {") and (
                        b"response.completed" in line or b"response.incomplete" in line
                    ):
                        await self._maybe_final(line[6:])
                yield chunk
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _maybe_final(self, data: bytes) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            return
        if event.get("type") in ("response.completed", "response.incomplete"):
            response = event.get("response")
            if isinstance(response, dict):
                await self.save(response)
