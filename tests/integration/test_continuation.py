"""A continued answer on the real engine: the text the first engine held
back for a stop string goes out first, and a stop string across the seam
ends the answer there (``worker.seam_stops``). Sent straight to the
session's worker, as a gateway sends a request that moves."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import zmq

from shared import protocol
from tests.conftest import MODEL, Served

PROMPT = "Q: Which city is the capital of France?\nA:"
# The answer so far, as the first worker generated it; it sent the client
# only " The", holding back the rest (it may begin a stop string).
SO_FAR = " The capital of"
SENT = " The"


def tokens(served: Served, text: str) -> list[int]:
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    answer = httpx.post(f"{served.base_url}/tokenize", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["tokens"])


def generate(
    served: Served, params: dict[str, Any], continuation: protocol.Continuation
) -> tuple[str, protocol.Delta, protocol.Usage]:
    """The answer's text, its last delta and its usage, from the worker itself."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"gw-continue-{uuid.uuid4().hex[:8]}".encode())
    sock.setsockopt(zmq.LINGER, 0)
    request_id = uuid.uuid4().hex
    body = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "max_tokens": 24, **params}
    generate = protocol.Generate(
        request_id=request_id,
        model=MODEL,
        kind="completion",
        params=body,
        continuation=continuation,
    )
    text, last = "", None
    try:
        sock.connect(served.worker_addresses(1))
        sock.send(protocol.encoder().encode(generate))
        decode = protocol.gateway_decoder().decode
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if not sock.poll(1000):
                continue
            for frame in sock.recv_multipart():
                message = decode(frame)
                if isinstance(message, protocol.Failed) and message.request_id == request_id:
                    raise AssertionError(f"the worker failed it: {message}")
                if not isinstance(message, protocol.Deltas):
                    continue
                for delta in message.items:
                    if delta.request_id != request_id:
                        continue
                    if delta.usage is not None:
                        assert last is not None
                        return text, last, delta.usage
                    text += delta.text
                    last = delta
        raise AssertionError("no usage within 120 s")
    finally:
        sock.close()
        ctx.term()


def test_held_back_text_goes_out_first_and_a_stop_string_across_the_seam_ends_it(
    served: Served,
) -> None:
    ids = tokens(served, SO_FAR)
    held = SO_FAR[len(SENT) :]
    # The same continuation with nothing held back: what the engine adds.
    added, _, whole = generate(served, {"stop": ["zzz"]}, protocol.Continuation(ids, len(SO_FAR)))
    assert added and whole.completion_tokens == 24

    text, last, usage = generate(served, {"stop": ["zzz"]}, protocol.Continuation(ids, len(SENT)))
    assert text == held + added
    assert usage.completion_tokens == 24

    # A stop string begun in the held-back text, ended by the new text.
    stop = "of" + added[:2]
    assert stop not in held + added[:1], "the stop string must cross the seam"
    text, last, usage = generate(served, {"stop": [stop]}, protocol.Continuation(ids, len(SENT)))
    assert text == held[: held.index("of")], text
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    # The engine stopped there: the carried tokens and the few it made.
    assert len(ids) < usage.completion_tokens < 24, usage
