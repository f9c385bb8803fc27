"""The gateway tokenizes a prompt as the engine does, from what the real worker sends
(``protocol.Describe`` -> ``protocol.Tokenizer``): the same token ids as vLLM's own
``/tokenize``, for a chat and for a completion's prompt."""

from __future__ import annotations

import time

import httpx
import zmq

from gateway.dispatch.tokens import PromptTokenizer
from shared import protocol
from tests.conftest import MODEL, Served

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a lighthouse. Ünïcödé 🚀"},
]


def described(served: Served, model: str = MODEL) -> protocol.Tokenizer:
    """Ask the served system's first worker for ``model``'s tokenizer, as a gateway does."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"gw-tokens-test")
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(served.worker_addresses(1))
        sock.send(protocol.encoder().encode(protocol.Describe(model=model)))
        decode = protocol.gateway_decoder().decode
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if not sock.poll(1000):
                continue
            for body in sock.recv_multipart():
                message = decode(body)
                if isinstance(message, protocol.Tokenizer):
                    return message
        raise AssertionError("the worker sent no tokenizer within 60 s")
    finally:
        sock.close()
        ctx.term()


def vllm_tokens(served: Served, body: dict[str, object]) -> list[int]:
    answer = httpx.post(f"{served.base_url}/tokenize", json={"model": MODEL, **body}, timeout=60)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["tokens"])


def test_the_gateways_token_ids_are_the_engines(served: Served) -> None:
    tokenizer = PromptTokenizer(described(served))
    assert tokenizer.chat(MESSAGES) == vllm_tokens(served, {"messages": MESSAGES})
    prompt = "Once upon a time, in a lighthouse,"
    assert tokenizer.completion(prompt) == vllm_tokens(served, {"prompt": prompt})
