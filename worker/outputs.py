"""vLLM's ``RequestOutput``s → :class:`shared.protocol.Delta` items, one per choice per step.

The job vLLM's ``OutputProcessor`` does for its front end, in the shape the
wire needs: each choice's index across the request's prompts, the prompt
echoed once, token logprobs as vLLM's server reports them, prompted keys
made plain (``worker.json_spans.key_prompts``), and the request's usage last.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from shared import protocol
from worker.json_spans import KeyRewriter
from worker.prepare import PreparedPrompt
from worker.seam_stops import SeamStops

log = logging.getLogger(__name__)

# vLLM reports -inf for impossible tokens; JSON has no infinity, and vLLM's
# own server clamps to this value.
_MIN_LOGPROB = -9999.0


class RequestDeltas:
    """One request's outputs, step by step, as deltas; its usage at the end."""

    def __init__(
        self,
        request_id: str,
        prompts: list[PreparedPrompt],
        tokenizer: Any,
        special_ids: frozenset[int],
    ) -> None:
        self.request_id = request_id
        self.prompts = prompts
        self.tokenizer = tokenizer
        self.special_ids = special_ids
        self.completion_tokens = 0
        # Said once, on the first delta: the engine has computed the prompts.
        self.prompt_tokens_told = False
        # The choices whose prompt has gone out as ``echo`` already.
        self.echoed: set[int] = set()
        self.rewriters: dict[int, KeyRewriter] = {}
        # A continued answer's check of its stop strings across the seam, by
        # choice; and whether one ended it (the engine did not see it).
        self.seams = {
            i * p.sampling_params.n: SeamStops(
                *p.seam_text,
                list(p.sampling_params.stop or ()),
                p.sampling_params.include_stop_str_in_output,
            )
            for i, p in enumerate(prompts)
            if p.seam_text is not None
        }
        self.stopped = False

    def step(self, prompt_index: int, output: Any) -> list[protocol.Delta]:
        """The deltas of one ``RequestOutput`` of prompt ``prompt_index``.

        Choice ``i`` of prompt ``p`` gets index ``p * n + i``, as in vLLM's
        completions endpoint.
        """
        prompt = self.prompts[prompt_index]
        n = prompt.sampling_params.n
        want_logprobs = prompt.sampling_params.logprobs is not None
        deltas = []
        for choice in output.outputs:
            self.completion_tokens += len(choice.token_ids)
            index = prompt_index * n + choice.index
            echo = echo_logprobs = echo_ids = None
            if prompt.echo_text is not None and index not in self.echoed:
                self.echoed.add(index)
                echo = prompt.echo_text
                echo_ids = list(output.prompt_token_ids or [])
                if want_logprobs and output.prompt_logprobs is not None:
                    echo_logprobs = self._prompt_logprobs(
                        output.prompt_token_ids or [], output.prompt_logprobs
                    )
            text, finish_reason, stop_reason = choice.text, choice.finish_reason, choice.stop_reason
            seam = self.seams.get(index)
            if seam is not None:
                text, stop = seam.feed(text, final=finish_reason is not None)
                if stop is not None:
                    finish_reason, stop_reason, self.stopped = "stop", stop, True
            deltas.append(
                protocol.Delta(
                    request_id=self.request_id,
                    index=index,
                    echo=echo,
                    echo_logprobs=echo_logprobs,
                    prompt_token_ids=echo_ids,
                    text=self._rewrite_keys(index, prompt, text, finish_reason),
                    num_tokens=len(choice.token_ids),
                    logprobs=(
                        token_logprobs(choice.token_ids, choice.logprobs, self.special_ids)
                        if want_logprobs and choice.logprobs is not None
                        else None
                    ),
                    finish_reason=finish_reason,
                    stop_reason=stop_reason,
                    token_ids=list(choice.token_ids),
                )
            )
        if deltas and not self.prompt_tokens_told:
            self.prompt_tokens_told = True
            deltas[0].prompt_tokens = self.prompt_tokens
        return deltas

    @property
    def prompt_tokens(self) -> int:
        """The request's prompt tokens: a continued answer's carried tokens
        (``PreparedPrompt.carried``) count as the answer's, not the prompt's."""
        return sum(p.prompt_tokens - p.carried for p in self.prompts)

    def usage(self) -> list[protocol.Delta]:
        """The request's last item: its usage, every prompt and choice counted
        (a continued answer's, both parts)."""
        usage = protocol.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens + sum(p.carried for p in self.prompts),
        )
        return [protocol.Delta(request_id=self.request_id, index=0, usage=usage)]

    def _rewrite_keys(
        self, index: int, prompt: PreparedPrompt, text: str, finish_reason: str | None
    ) -> str:
        """``text`` with prompted keys made plain; as is without them."""
        if not prompt.key_prompts:
            return text
        rewriter = self.rewriters.get(index)
        if rewriter is None:
            rewriter = self.rewriters[index] = KeyRewriter(prompt.key_prompts)
        out = rewriter.feed(text, final=finish_reason is not None)
        if finish_reason is not None:
            log.info(
                "request %s choice %d: prompted keys generated: %s",
                self.request_id,
                index,
                ", ".join(rewriter.generated) or "none",
            )
        return out

    def _prompt_logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[Any]
    ) -> list[protocol.TokenLogprob]:
        """The prompt's tokens as ``echo`` with ``logprobs`` reports them, like vLLM.

        The engine scores every prompt token but the first (``None``); that one
        is decoded by the tokenizer and marked unscored.
        """
        scored = token_logprobs(token_ids, logprobs, self.special_ids)
        if token_ids and len(logprobs) and not logprobs[0]:  # None, or empty when flat
            first = token_ids[0]
            scored[0] = protocol.TokenLogprob(
                token=self.tokenizer.decode(first), logprob=0.0, token_id=first, scored=False
            )
        return scored


def token_logprobs(
    token_ids: Iterable[int], logprobs: Iterable[Any], special_ids: frozenset[int]
) -> list[protocol.TokenLogprob]:
    """Each token's logprob, its alternatives by rank, clamped as vLLM's server clamps."""
    out = []
    for token_id, step in zip(token_ids, logprobs, strict=False):
        step = step or {}
        chosen = step.get(token_id)
        ranked = sorted(step.items(), key=lambda kv: kv[1].rank or 0)
        out.append(
            protocol.TokenLogprob(
                token=_token_text(chosen, token_id),
                logprob=max(chosen.logprob, _MIN_LOGPROB) if chosen else _MIN_LOGPROB,
                top=[
                    protocol.TopLogprob(
                        _token_text(lp, tid), max(lp.logprob, _MIN_LOGPROB), tid, lp.rank or 0
                    )
                    for tid, lp in ranked
                ],
                token_id=token_id,
                special=token_id in special_ids,
                rank=(chosen.rank or 0) if chosen else 0,
            )
        )
    return out


def _token_text(logprob: Any, token_id: int) -> str:
    if logprob is not None and logprob.decoded_token is not None:
        return str(logprob.decoded_token)
    return f"token_id:{token_id}"
