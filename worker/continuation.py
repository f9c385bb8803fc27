"""A request continued from the tokens another worker generated for it.

When a worker fails mid-answer, the gateway sends the request to another
worker with the token ids its one choice had generated
(``Generate.continuation``). The prompt is rendered as for a new request
(the same template, so the same ids); :func:`continued` appends those ids
to it, so the engine goes on where the answer stopped, and takes them off
``max_tokens`` and ``min_tokens``. They stay the answer's in the usage
(``PreparedPrompt.carried``, ``worker.outputs``). The limits were checked on
the prompt as sent, before this. With ``stop`` strings, the text of those
tokens past what the client was sent (``Continuation.sent_chars``: the first
engine held it back) goes out first, and the stop strings are checked
across the seam (``worker.seam_stops``).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from shared import protocol
from worker import sampling
from worker.errors import RequestError
from worker.prepare import PreparedPrompt

log = logging.getLogger(__name__)


def continued(
    prompts: list[PreparedPrompt],
    continuation: protocol.Continuation,
    model_config: Any,
    tokenizer: Any = None,
) -> list[PreparedPrompt]:
    """``prompts`` (one prompt of one choice) continued by ``continuation``."""
    if len(prompts) != 1 or prompts[0].sampling_params.n != 1:
        raise RequestError(400, "Only a request of one prompt and one choice can continue.")
    prompt = prompts[0]
    params = prompt.sampling_params.clone()
    tokens = continuation.token_ids
    carried = len(tokens)
    if params.max_tokens is not None:
        if params.max_tokens <= carried:
            raise RequestError(400, "The continued answer has no tokens left to generate.")
        params.max_tokens -= carried
    params.min_tokens = max(0, params.min_tokens - carried)
    ids = sampling.prompt_token_ids(model_config, prompt.engine_input)
    engine_input = dict(prompt.engine_input) if isinstance(prompt.engine_input, dict) else {}
    # Its text would name the prompt without the continuation.
    engine_input.pop("prompt", None)
    engine_input["prompt_token_ids"] = [*ids, *tokens]
    return [
        replace(
            prompt,
            engine_input=engine_input,
            sampling_params=params,
            prompt_tokens=prompt.prompt_tokens + carried,
            carried=carried,
            seam_text=seam_text(params, continuation, tokenizer),
        )
    ]


def seam_text(
    params: Any, continuation: protocol.Continuation, tokenizer: Any
) -> tuple[str, str] | None:
    """For a request with stop strings: the end of the text the client was
    sent (as long as the longest stop string) and the text it was not sent
    (the first engine held it back); None without stop strings."""
    stops = [s for s in (params.stop or ()) if s]
    if not stops or tokenizer is None:
        return None
    text = tokenizer.decode(continuation.token_ids, skip_special_tokens=params.skip_special_tokens)
    sent = continuation.sent_chars
    if sent > len(text):
        # The tokens' text is not what was sent (a tokenizer that decodes a
        # sequence otherwise than token by token): check from the seam on.
        log.warning("the continued tokens decode to less text than was sent: no held text")
        sent = len(text)
    longest = max(len(s) for s in stops)
    return text[max(0, sent - longest + 1) : sent], text[sent:]
