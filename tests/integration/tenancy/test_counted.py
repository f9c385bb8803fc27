"""What each path costs its key: every route that makes the engine compute, tried whole,
streamed without asking for usage, with a field only vLLM's server answers, cancelled
half-way and with two choices, each through one of two gateways sharing Redis and
PostgreSQL, each under a key of its own; a response-cache hit through the other
gateway and a batch's lines; and a small token limit held on every path.

Generated from the route table: :func:`test_every_route_is_known_to_compute_or_not`
fails for a new route until it is classified here. Greedy answers with ``ignore_eos``
generate exactly ``max_tokens`` a choice, and the prompt's tokens are vLLM's own count
(``/tokenize``), so what a key should have been charged is known without trusting
what the gateway told the client.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from shared import routes
from tests.conftest import MODEL
from tests.integration.tenancy.conftest import ADMIN, Tenancy
from tests.integration.test_pool import wait_for

TOKENS = 4  # generated a choice
LIMIT = 60  # tokens a minute: two or three answers
LONG = 64  # a stream long enough to leave half-way
PROMPT = "Counted: name a colour."
MESSAGES = [{"role": "user", "content": PROMPT}]

# Routes that make the engine compute (a body to send for each), and those that do not.
COMPUTING: dict[str, Callable[[str], dict[str, Any]]] = {
    routes.COMPLETIONS.path: lambda variant: {"prompt": PROMPT},
    routes.CHAT.path: lambda variant: {"messages": MESSAGES},
    routes.INVOCATIONS.path: lambda variant: {"messages": MESSAGES},
    routes.CHAT_BATCH.path: lambda variant: {"messages": [MESSAGES, MESSAGES]},
    routes.RESPONSES.path: lambda variant: {"input": PROMPT, "max_output_tokens": TOKENS},
    routes.MESSAGES.path: lambda variant: {"messages": MESSAGES, "max_tokens": TOKENS},
    routes.TGI_GENERATE.path: lambda variant: {"inputs": PROMPT},
    routes.TGI_GENERATE_STREAM.path: lambda variant: {"inputs": PROMPT},
    routes.TGI_COMPAT.path: lambda variant: {"inputs": PROMPT},
}
NOT_COMPUTING = {
    r.path
    for r in (
        routes.MODELS,
        routes.FILES,
        routes.FILE,
        routes.FILE_CONTENT,
        routes.BATCHES,
        routes.BATCH,
        routes.BATCH_CANCEL,
        routes.USAGE,
        routes.TOKENIZE,
        routes.DETOKENIZE,
        routes.MESSAGES_COUNT_TOKENS,
        routes.VERSION,
        routes.PING,
        routes.RESPONSE,
        routes.RESPONSE_CANCEL,
        routes.HEALTH,
        routes.METRICS,
        routes.READY,
    )
}
# The OpenAI completion and chat routes: every variant applies.
OPENAI = (routes.COMPLETIONS.path, routes.CHAT.path)
STREAMING = (*OPENAI, routes.RESPONSES.path, routes.MESSAGES.path, routes.TGI_GENERATE_STREAM.path)


@dataclass(frozen=True)
class Case:
    path: str
    variant: str

    @property
    def key(self) -> str:
        return f"counted{self.path.replace('/', '-')}-{self.variant}"

    def __str__(self) -> str:
        return f"{self.path} {self.variant}"


CASES = [Case(path, "whole") for path in COMPUTING]
CASES += [Case(path, "stream") for path in STREAMING]
CASES += [Case(path, v) for path in OPENAI for v in ("forwarded", "forwarded-stream")]
CASES += [Case(path, v) for path in OPENAI for v in ("cancelled", "forwarded-cancelled", "n2")]
# Every path whole, and the streams vLLM's server answers without usage asked
# for (they were once settled at nothing).
LIMITED = [Case(path, "whole") for path in COMPUTING]
LIMITED += [Case(path, "forwarded-stream") for path in OPENAI]


def test_every_route_is_known_to_compute_or_not() -> None:
    known = COMPUTING.keys() | NOT_COMPUTING
    assert {r.path for r in routes.ROUTES} == known
    assert not COMPUTING.keys() & NOT_COMPUTING


def body_of(case: Case) -> dict[str, Any]:
    """The case's request body: greedy, ``ignore_eos`` where the dialect has it."""
    body = {"model": MODEL, **COMPUTING[case.path](case.variant)}
    if case.path in (*OPENAI, routes.INVOCATIONS.path, routes.CHAT_BATCH.path):
        cancelled = case.variant.endswith("cancelled")
        body.update(temperature=0, ignore_eos=True, max_tokens=LONG if cancelled else TOKENS)
    elif case.path.startswith("/generate") or case.path == "/":
        body["parameters"] = {"max_new_tokens": TOKENS, "details": True}
    if "forwarded" in case.variant:
        body["return_token_ids"] = True
    if case.variant == "n2":
        body.update(n=2, temperature=1.0, seed=7)  # greedy takes one choice only
    if "stream" in case.variant or case.variant.endswith("cancelled"):
        body["stream"] = True
    return body


def prompt_tokens(tenancy: Tenancy, case: Case) -> int:
    """vLLM's own count of the case's prompt (an operator's ``/tokenize``)."""
    body: dict[str, Any] = {"model": MODEL}
    if case.path in (routes.COMPLETIONS.path, *(r.path for r in TGI)):
        body["prompt"] = PROMPT
    else:
        body["messages"] = MESSAGES
    response = tenancy.client(ADMIN).post("/tokenize", json=body)
    assert response.status_code == 200, response.text
    count: int = response.json()["count"]
    return count


TGI = (routes.TGI_GENERATE, routes.TGI_GENERATE_STREAM, routes.TGI_COMPAT)


@pytest.fixture(scope="module")
def keyed(tenancy: Tenancy) -> Iterator[Tenancy]:
    """Every case's key, known to both gateways."""
    for case in CASES:
        tenancy.key(case.key)
    for case in LIMITED:
        tenancy.key(limited(case), tokens_per_minute=LIMIT)
    tenancy.key("counted-cache")
    tenancy.key("counted-batch")
    tenancy.known(CASES[-1].key)  # the file is read whole: the others are known too
    yield tenancy


def events(response: httpx.Response) -> Iterator[dict[str, Any]]:
    for line in response.iter_lines():
        if line.startswith("data:") and line[5:].strip().startswith("{"):
            yield json.loads(line[5:].strip())


def recorded(tenancy: Tenancy, key: str, requests: int) -> dict[str, int]:
    """The key's usage once ``requests`` of its requests are in the ledger."""
    http = tenancy.client(key, 1)

    def total() -> dict[str, int]:
        answer = http.get("/v1/usage")
        assert answer.status_code == 200, answer.text
        value: dict[str, int] = answer.json()["total"]
        return value

    wait_for(lambda: total()["requests"] >= requests, 60, show=lambda: str(total()))
    return total()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_each_path_is_settled_with_the_engines_counts(keyed: Tenancy, case: Case) -> None:
    http = keyed.client(case.key, CASES.index(case) % 2)
    body = body_of(case)
    told: dict[str, int] | None = None  # what the client was told, where it was
    received = 0
    if body.get("stream") or case.path == routes.TGI_GENERATE_STREAM.path:
        with http.stream("POST", case.path, json=body) as response:
            assert response.status_code == 200, response.read()
            for value in events(response):
                # Asked for none: no usage on any chunk of an OpenAI stream.
                if case.path in OPENAI:
                    assert value.get("usage") is None, value
                received += sum(map(_tokens, value.get("choices", [])))
                told = _merged(told, _told(value))
                if case.variant.endswith("cancelled") and received >= 3:
                    break
    else:
        response = http.post(case.path, json=body)
        assert response.status_code == 200, response.text
        answer = response.json()
        # TGI's compatibility route answers a list of one.
        told = _told(answer[0] if isinstance(answer, list) else answer)
    usage = recorded(keyed, case.key, 1)
    assert usage["requests"] == 1, usage
    tgi = case.path in (r.path for r in TGI)
    if case.path in (*OPENAI, routes.INVOCATIONS.path, routes.CHAT_BATCH.path) or tgi:
        conversations = 2 if case.path == routes.CHAT_BATCH.path else 1
        assert usage["prompt_tokens"] == conversations * prompt_tokens(keyed, case), usage
    else:  # the chat template under another dialect's rendering: what the client was told
        assert told is not None and told["prompt"] >= 0, told
        assert usage["prompt_tokens"] == told["prompt"], (usage, told)
    if case.variant.endswith("cancelled"):
        # Billed what the engine computed: what the client got, not the 64 it might have.
        assert received <= usage["completion_tokens"] < LONG, usage
    elif case.path in (*OPENAI, routes.INVOCATIONS.path, routes.CHAT_BATCH.path):
        conversations = 2 if case.path == routes.CHAT_BATCH.path else 1
        choices = conversations * (2 if case.variant == "n2" else 1)
        assert usage["completion_tokens"] == TOKENS * choices, usage
    else:  # no ignore_eos in the dialect: the engine's count as the client was told it
        assert told is not None, "no usage in the answer"
        assert usage["completion_tokens"] == told["completion"], (usage, told)
    if told is not None and told["prompt"] >= 0:
        # What the client was told is what its key was charged.
        assert told["prompt"] == usage["prompt_tokens"], (told, usage)
        assert told["completion"] == usage["completion_tokens"], (told, usage)


def _tokens(choice: dict[str, Any]) -> int:
    """The tokens a stream chunk's choice carries: its ids when returned, else
    one for a chunk with text (vLLM's streams send a token or more a chunk)."""
    if choice.get("token_ids"):
        return len(choice["token_ids"])
    delta = choice.get("delta") or {}
    return 1 if choice.get("text") or delta.get("content") else 0


def _merged(before: dict[str, int] | None, now: dict[str, int] | None) -> dict[str, int] | None:
    """A stream's counts so far: the latest of each (Anthropic's come in two events)."""
    if before is None or now is None:
        return now or before
    return {
        "prompt": now["prompt"] if now["prompt"] >= 0 else before["prompt"],
        "completion": now["completion"],
    }


def _told(value: dict[str, Any]) -> dict[str, int] | None:
    """The token counts an answer (or one of its events) reports, in any dialect."""
    usage = value.get("usage")
    if isinstance(value.get("response"), dict):  # a Responses API event
        usage = value["response"].get("usage")
    if isinstance(value.get("message"), dict):  # Anthropic's message_start
        usage = value["message"].get("usage")
    details = value.get("details")
    if isinstance(details, dict) and "generated_tokens" in details:
        return {"prompt": -1, "completion": int(details["generated_tokens"])}
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens"))
    if not isinstance(completion, int):
        return None
    return {"prompt": prompt if isinstance(prompt, int) else -1, "completion": completion}


def limited(case: Case) -> str:
    return f"limited{case.path.replace('/', '-')}-{case.variant}"


@pytest.mark.parametrize("case", LIMITED, ids=str)
def test_a_small_token_limit_holds_on_every_path(keyed: Tenancy, case: Case) -> None:
    statuses: list[int] = []
    for n in range(8):  # through both gateways, which share the limits in Redis
        # A prompt of its own each time: a cache hit would rightly cost nothing.
        body = json.loads(json.dumps(body_of(case)).replace(PROMPT, f"{PROMPT} {n}"))
        response = keyed.client(limited(case), n % 2).post(case.path, json=body)
        statuses.append(response.status_code)
        if response.status_code == 429:
            break
        assert response.status_code == 200, response.text
    assert statuses[-1] == 429, statuses
    # Each answer was charged what it cost: the key got no more than its limit
    # and the one reservation the limit admitted last.
    usage = recorded(keyed, limited(case), statuses.count(200))
    spent = usage["prompt_tokens"] + usage["completion_tokens"]
    assert spent <= LIMIT + spent / usage["requests"] + LIMIT * 0.5, (statuses, usage)


def test_a_cache_hit_is_counted_as_its_client_was_told_with_no_engine_work(
    keyed: Tenancy,
) -> None:
    body = {"model": MODEL, "prompt": f"{PROMPT} cached", "max_tokens": TOKENS, "temperature": 0}
    first = keyed.client("counted-cache", 0).post(routes.COMPLETIONS.path, json=body)
    # The other gateway: the cache is in the Redis both share.
    again = keyed.client("counted-cache", 1).post(routes.COMPLETIONS.path, json=body)
    assert first.status_code == again.status_code == 200, (first.text, again.text)
    assert (first.headers["x-llmgate-cache"], again.headers["x-llmgate-cache"]) == ("miss", "hit")
    told = first.json()["usage"]
    assert again.json()["usage"] == told
    usage = recorded(keyed, "counted-cache", 2)
    assert usage["prompt_tokens"] == 2 * told["prompt_tokens"]
    assert usage["completion_tokens"] == 2 * told["completion_tokens"]
    # What no engine computed: the hit's tokens.
    assert usage["cached_tokens"] == told["prompt_tokens"] + told["completion_tokens"]


def test_a_batchs_lines_are_counted_against_its_key(keyed: Tenancy) -> None:
    sdk = openai.OpenAI(
        base_url=f"{keyed.gateways[1].base_url}/v1",
        api_key=keyed.key("counted-batch"),
        max_retries=0,
    )
    lines = [
        {
            "custom_id": f"req-{n}",
            "method": "POST",
            "url": routes.COMPLETIONS.path,
            "body": {"model": MODEL, "prompt": f"{PROMPT} batch {n}", "max_tokens": TOKENS},
        }
        for n in range(2)
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch").id
    batch_id = sdk.batches.create(
        input_file_id=file_id, endpoint=routes.COMPLETIONS.path, completion_window="24h"
    ).id
    wait_for(lambda: sdk.batches.retrieve(batch_id).status in ("completed", "failed"), 300)
    batch = sdk.batches.retrieve(batch_id)
    assert batch.status == "completed" and batch.output_file_id, batch
    answers = [
        json.loads(line)["response"]["body"]["usage"]
        for line in sdk.files.content(batch.output_file_id).text.splitlines()
    ]
    usage = recorded(keyed, "counted-batch", len(lines))
    assert usage["requests"] == len(lines)
    assert usage["prompt_tokens"] == sum(a["prompt_tokens"] for a in answers)
    assert usage["completion_tokens"] == sum(a["completion_tokens"] for a in answers)
