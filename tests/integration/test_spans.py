"""Span extraction and key prompting, end to end with the real engine (issue 14).

Every case of ``span_cases.CASES`` runs three ways through the gateway, at
temperature 0: with ``x-span`` (plain and streaming) and without it. With it,
every string value must be a substring of the source and the JSON must
validate; without it, the embedded model paraphrases at least once, which the
report (printed, and written to the test's tmp dir) shows.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.conftest import MODEL, Served
from tests.integration.span_cases import CASES, Case

MAX_TOKENS = 200
# A CPU engine's step reads every weight whatever the batch, so sixteen
# requests at once cost little more a step than eight: the module's ~100
# requests took 28 s instead of 35 on an idle machine.
CONCURRENCY = 16


@dataclass
class Outcome:
    case: Case
    span: bool
    stream: bool
    text: str
    finish_reason: str | None

    def value(self) -> Any:
        return json.loads(self.text)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    return []


def _body(case: Case, span: bool, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": case.messages(),
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": stream,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "extraction", "schema": case.schema(span)},
        },
    }


async def _chat(client: httpx.AsyncClient, body: dict[str, Any]) -> tuple[str, str | None]:
    """(text, finish reason) of one chat request, streaming or not."""
    if not body["stream"]:
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["message"]["content"], choice["finish_reason"]
    text, finish = [], None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
    return "".join(text), finish


async def _run_all(base_url: str) -> list[Outcome]:
    limit = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(case: Case, span: bool, stream: bool) -> Outcome:
            async with limit:
                text, finish = await _chat(client, _body(case, span, stream))
            return Outcome(case, span, stream, text, finish)

        runs = [(c, span, stream) for c in CASES for span, stream in [(1, 0), (1, 1), (0, 0)]]
        return await asyncio.gather(*(one(c, bool(s), bool(t)) for c, s, t in runs))


@pytest.fixture(scope="module")
def outcomes(served: Served) -> list[Outcome]:
    return asyncio.run(_run_all(served.base_url))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_every_span_value_is_a_substring_and_the_json_validates(
    outcomes: list[Outcome], stream: bool
) -> None:
    checked = 0
    for outcome in outcomes:
        if not outcome.span or outcome.stream != stream:
            continue
        case = outcome.case
        assert outcome.finish_reason == "stop", (case.name, outcome.text)
        value = outcome.value()
        jsonschema.validate(value, case.schema(span=False))
        for text in _strings(value):
            assert text in case.source, (case.name, text)
            checked += 1
    assert len(CASES) >= 30 and checked >= len(CASES)


def test_without_x_span_the_model_paraphrases(outcomes: list[Outcome], tmp_path: Path) -> None:
    rows = []
    for outcome in outcomes:
        if outcome.span:
            continue
        try:
            values = _strings(outcome.value())
        except json.JSONDecodeError:
            values = [outcome.text]  # cut off: all of it is "not a span"
        rows += [(outcome.case.name, v) for v in values if v not in outcome.case.source]
    report = "\n".join(
        ["values not in the source without x-span:", *(f"  {name}: {v!r}" for name, v in rows)]
    )
    (tmp_path / "not-substrings.txt").write_text(report + "\n")
    print("\n" + report)
    assert rows, "without x-span every value was a span: the test shows nothing"


SCHEMA_WITH_KEY_PROMPTS = {
    "type": "object",
    "x-key-prompt": True,
    "properties": {
        "name": {"type": "string", "x-span": True, "description": "the person named first"},
        "birth_date": {"type": "string", "x-span": True, "description": "as written in the text"},
        "city": {"type": "string", "x-key-prompt": False},
    },
    "required": ["name", "birth_date", "city"],
    "additionalProperties": False,
}
SOURCE = "Ada Lovelace was born on 10 December 1815 in London. Charles Babbage was her friend."


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_key_prompts_are_generated_and_the_client_sees_plain_keys(
    served: Served, stream: bool
) -> None:
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Extract the person."},
            {"role": "user", "content": SOURCE},
        ],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "stream": stream,
        "user": f"key-prompts-{stream}",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA_WITH_KEY_PROMPTS},
        },
    }

    async def go() -> tuple[str, str | None]:
        async with httpx.AsyncClient(base_url=served.base_url, timeout=600) as client:
            return await _chat(client, body)

    text, finish = asyncio.run(go())
    assert finish == "stop", text
    value = json.loads(text)
    assert list(value) == ["name", "birth_date", "city"]
    assert value["name"] in SOURCE and value["birth_date"] in SOURCE
    served.wait_for_log(
        'prompted keys generated: "name (the person named first)", '
        '"birth_date (as written in the text)"'
    )


def test_completions_with_structured_outputs_and_span_source(served: Served) -> None:
    source = 'Order #4471: 3 × "Blue Widget" shipped to Zürich.'  # noqa: RUF001
    body = {
        "model": MODEL,
        "prompt": "Extract the product from the order as JSON.\n",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "span_source": source,
        "structured_outputs": {
            "json": {
                "type": "object",
                "properties": {"product": {"type": "string", "x-span": True, "minLength": 1}},
                "required": ["product"],
            }
        },
    }
    response = httpx.post(f"{served.base_url}/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    product = json.loads(response.json()["choices"][0]["text"])["product"]
    assert product and product in source


def test_x_span_on_a_number_is_400_naming_the_property(served: Served) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tom is 42."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "x",
                "schema": {
                    "type": "object",
                    "properties": {"age": {"type": "number", "x-span": True}},
                },
            },
        },
    }
    response = httpx.post(f"{served.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "'age'" in error["message"] and "x-span" in error["message"]
