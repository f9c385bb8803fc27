"""A request continued from the tokens another worker generated for it.

When a worker fails mid-answer, the gateway sends the request to another
worker with the token ids its one choice had generated
(``Generate.continuation``). The prompt is rendered as for a new request
(the same template, so the same ids); :func:`continued` appends those ids
to it, so the engine goes on where the answer stopped, and takes them off
``max_tokens`` and ``min_tokens``. They stay the answer's in the usage
(``PreparedPrompt.carried``, ``worker.outputs``). The limits were checked on
the prompt as sent, before this.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from worker import sampling
from worker.errors import RequestError
from worker.prepare import PreparedPrompt


def continued(
    prompts: list[PreparedPrompt], continuation: list[int], model_config: Any
) -> list[PreparedPrompt]:
    """``prompts`` (one prompt of one choice) continued by ``continuation``."""
    if len(prompts) != 1 or prompts[0].sampling_params.n != 1:
        raise RequestError(400, "Only a request of one prompt and one choice can continue.")
    prompt = prompts[0]
    params = prompt.sampling_params.clone()
    carried = len(continuation)
    if params.max_tokens is not None:
        if params.max_tokens <= carried:
            raise RequestError(400, "The continued answer has no tokens left to generate.")
        params.max_tokens -= carried
    params.min_tokens = max(0, params.min_tokens - carried)
    ids = sampling.prompt_token_ids(model_config, prompt.engine_input)
    engine_input = dict(prompt.engine_input) if isinstance(prompt.engine_input, dict) else {}
    # Its text would name the prompt without the continuation.
    engine_input.pop("prompt", None)
    engine_input["prompt_token_ids"] = [*ids, *continuation]
    return [
        replace(
            prompt,
            engine_input=engine_input,
            sampling_params=params,
            prompt_tokens=prompt.prompt_tokens + carried,
            carried=carried,
        )
    ]
