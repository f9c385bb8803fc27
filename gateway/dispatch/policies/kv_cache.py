"""Cache-aware routing (``kv``): a request goes where its prompt is already cached.

The prompt's token ids, as the engine will see them (the chat template
applied: ``gateway.dispatch.tokens``), are cut into blocks of each worker's
block size and keyed as the index keys the engines' KV events
(``gateway.dispatch.kv_index``), which then says how many leading blocks of
the prompt each engine holds. Among the workers within the prefix policy's
load bound (``PrefixAffinity.bound``: a hot prefix spreads rather than piles
onto one engine), the one holding the most prompt tokens takes it; ties go to
the less loaded, then by rendezvous hashing, alike in every replica. A run
of blocks in much of the recent traffic (a hot system prompt) spreads over
as many engines as its traffic needs, and each replica evens out its own
requests over them.

Where no worker within the bound holds any of it, the request is placed by
rendezvous hashing of a key over the workers within the bound, load aside,
so every replica places it alike: the key is the client's hint if it gave
one, else the prompt's leading blocks (so a document's first questions,
sent before any event says where it went, land together). A placement is
remembered with the worker's incarnation (a worker that restarted is not
chosen for what it held before). A LoRA adapter's prompt is keyed from the
adapter's name, as the index keys its blocks: an adapter and its base model
never share a cached run. Requests it cannot tokenize (a model whose tokenizer
no worker sent, vLLM's own routes) or that reach workers with no KV events
are ``prefix``'s.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gateway.dispatch.kv_index import block_keys
from gateway.dispatch.policies import CacheView, RoutingContext, load
from gateway.dispatch.policies.prefix import REMEMBERED_KEYS, PrefixAffinity, score

if TYPE_CHECKING:
    from gateway.dispatch.tokens import PromptTokenizer
    from gateway.dispatch.workers import Worker

log = logging.getLogger(__name__)

# Leading blocks that name a prompt's placement when nothing of it is cached:
# at vLLM's 16 tokens a block, its first 128 tokens (a document, shared
# instructions), not the question after them.
PLACEMENT_BLOCKS = 8
# Seconds after which a cached run's request counts half as much, for telling
# a hot prefix (more of the traffic than its holders' share of the workers):
# short, so a prompt that turns hot under heavy traffic counts as such within
# seconds (at 10 s, a simulated fleet's hot prompt went unnoticed for most
# of a run that followed another workload).
HEAT_HALF_LIFE = 2.0
# Decayed requests a run needs before it counts as hot (at least 8 within a
# few seconds): one conversation's turns never do.
HOT_REQUESTS = 8.0
# Blocks between the points a request is counted at (at vLLM's 16 tokens a
# block, every 64 tokens), and at each block past the last of them.
HOT_STRIDE = 4
# Seconds after which this replica's placement of a prompt nothing holds counts
# half as much, for the room other replicas are taken to use alike on the same
# worker: the heartbeat interval, in which their requests become known.
PLACING_HALF_LIFE = 1.0
# Characters of a prompt tokenized afresh to see whether any engine holds its
# start (about 450 tokens of English text): at least PLACEMENT_BLOCKS blocks.
PROBE_CHARS = 2048


class CacheAware:
    uses_key = True

    def __init__(self, caches: CacheView, affinity: PrefixAffinity) -> None:
        caches.wants_tokenizers = True
        self.caches = caches
        self.affinity = affinity
        # Placement key -> (worker address, its incarnation), oldest first.
        self._placed: OrderedDict[str, tuple[str, str]] = OrderedDict()
        # How much of the recent traffic each cached run brought.
        self._heat = Heat()
        # This replica's placements lately, per (placement key, worker).
        self._placing = Heat(PLACING_HALF_LIFE)
        self._rng = random.Random()

    def select(self, context: RoutingContext) -> Worker:
        looked_up = self._look_up(context)
        if looked_up is None:
            return self.affinity.select(context)
        held, placement, chain = looked_up
        self._heat.request()
        if context.hinted and context.key is not None:
            placement = context.key
        bound = self.affinity.bound(context)
        under = [w for w in context.candidates if load(w) + 1 <= bound]
        if held and under:
            best = max(
                under,
                key=lambda w: (held.get(w.address, 0), -load(w), score(placement, w.key)),
            )
            top = held.get(best.address, 0)
            if top:
                return self._spread(best, top, chain, held, under, context)
        return self._place(under, placement, bound, context)

    def _spread(
        self,
        best: Worker,
        top: int,
        chain: tuple[int, list[int]],
        held: dict[str, int],
        under: list[Worker],
        context: RoutingContext,
    ) -> Worker:
        """``best`` holds the most of the prompt (``top`` tokens); unless the run it
        shares with other requests is hot, it takes the request.

        Requests are counted at every ``HOT_STRIDE``-th block of what is held
        and at each block past the last of those (``Heat``). A run that
        brought ``HOT_REQUESTS`` lately is hot, to the block. Then a request
        that holds no more than a block of its own past the run (a first turn
        behind shared instructions) goes to the holder of the run this gateway
        has the fewest requests on: each replica evens out its own requests,
        which evens out the sum, where the others' load, known from
        heartbeats up to a second old, would send every replica to the same
        one. And while the run has fewer holders than its share of the
        workers times the load factor (the rest of the traffic lands on its
        holders too), a worker that does not hold it yet and is no more
        loaded than the least loaded holder takes it instead, and holds it
        from then on. A request that holds more of its own (a conversation's
        history) stays where it is held."""
        size, keys = chain
        reach = min(top // size, len(keys))
        # Counted at each stride, and at each block past the last one: where a
        # first turn's held run ends (the shared part), every such request
        # counts the same blocks.
        last = reach - reach % HOT_STRIDE
        depths = [*range(HOT_STRIDE, last + 1, HOT_STRIDE), *range(last + 1, reach + 1)]
        counted: dict[int, float] = {}
        hot, share = 0, 0.0
        for depth in depths:
            requests, of_all = self._heat.count(keys[depth - 1])
            counted[depth] = requests
            if requests >= HOT_REQUESTS and depth % HOT_STRIDE == 0:
                hot, share = depth, of_all
        if not hot:
            return best
        # To the block: a request that holds more than the run (a turn after
        # it) did not count the blocks past its stride, others did.
        while hot < reach:
            depth = hot + 1
            lately = counted[depth] if depth in counted else self._heat.peek(keys[hot])
            if lately < HOT_REQUESTS:
                break
            hot = depth
        if top - hot * size > size:
            return best
        run = hot * size
        holding = [w for w in under if held.get(w.address, 0) >= run]
        holders = sum(1 for w in context.candidates if held.get(w.address, 0) >= run)
        # Ties at random: a hot run's requests all have the same placement
        # key, and a tie broken by it sends every one to the same worker.
        rng = self._rng.random
        least = min(holding, key=lambda w: (w.in_flight, rng()))
        n = len(context.candidates)
        if holders < min(n, math.ceil(share * n * self.affinity.load_factor)):
            others = [w for w in under if held.get(w.address, 0) < run]
            if others:
                idle = min(others, key=lambda w: (load(w), rng()))
                if load(idle) <= min(load(w) for w in holding):
                    return idle
        return least

    def _look_up(
        self, context: RoutingContext
    ) -> tuple[dict[str, int], str, tuple[int, list[int]]] | None:
        """Prompt tokens each worker's engine holds (only those holding some), the
        prompt's placement key, and the smallest block size with the prompt's keys
        in it; None where the prompt cannot be read or no candidate publishes
        events.

        A prompt unseen by this process costs a tokenizing of ``PROBE_CHARS``
        characters: the whole is tokenized only when some engine holds all of the
        start read (no engine can hold more of a prompt than of its start)."""
        order = context.order
        if order is None:
            return None
        sizes = {self.caches.kv.block_size(w.address) for w in context.candidates} - {0}
        tokenizer = self.caches.tokenizers.get(context.model)
        if not sizes or tokenizer is None:
            return None
        start = prompt_tokens(tokenizer, order.kind, order.params, PROBE_CHARS)
        if start is None:
            return None
        tokens, cut = start
        # An adapter's blocks are its own: keyed from its name, as the index keys
        # what its engines store for it.
        lora = self.caches.adapters.get(context.model)
        index = self.caches.kv.index
        held: dict[str, int] = {}
        chain: tuple[int, list[int]] | None = None
        placement = ""
        whole: Sequence[int] | None = None
        for size in sorted(sizes):
            # The word a cut falls in may tokenize otherwise than in the whole:
            # the last block before the cut is left out.
            keys = block_keys(tokens[: len(tokens) - size] if cut else tokens, size, lora)
            if not keys:
                continue
            placement = placement or f"kv:{keys[min(len(keys), PLACEMENT_BLOCKS) - 1]}"
            found = index.match(keys)
            if cut and found and max(found.values()) == len(keys):
                if whole is None:
                    rest = prompt_tokens(tokenizer, order.kind, order.params)
                    whole = rest[0] if rest is not None else tokens
                keys = block_keys(whole, size, lora)
                found = index.match(keys)
            chain = chain or (size, keys)
            for address, depth in found.items():
                held[address] = max(held.get(address, 0), depth * size)
        if chain is None:
            return None  # shorter than a block: nothing to find
        return held, placement, chain

    def _place(self, under: list[Worker], key: str, bound: int, context: RoutingContext) -> Worker:
        """Nothing of the prompt is cached within the bound: its placement, or a new one.

        Every replica places a key on the same worker, and none sees the
        others' requests there until the worker's next heartbeat: a burst of
        one new prompt (a system prompt turning hot at once) would reach that
        worker from every replica, each filling the bound as if alone. So a
        worker counts, for the key, this replica's own placements of it lately
        (``PLACING_HALF_LIFE``) as many times as there are gateway processes
        (the worker's heartbeat says how many): past the bound, the key's
        next worker by rendezvous hashing takes the request, alike in every
        replica, until the events say who holds the prompt. Behind one gateway
        this is the plain bound. It takes the others to send the prompt as this
        one does: a replica that alone sends a new document's questions at once
        starts it on a second worker sooner than the plain bound would."""
        if not under:
            return self.affinity.select(context)  # every worker at the bound
        home = self._placed.get(key)
        placed = next((w for w in under if (w.address, w.incarnation) == home), None)
        if placed is not None and self._room(placed, key, bound):
            self._placed.move_to_end(key)
            self._placing.count(hash((key, placed.address)))
            return placed
        # By rendezvous hashing alone, load aside within the bound: every replica
        # places a new document on the same worker, though its view of the
        # load differs (two gateways that each chose the less loaded computed
        # many documents on both workers).
        ranked = sorted(under, key=lambda w: score(key, w.key), reverse=True)
        chosen = next((w for w in ranked if self._room(w, key, bound)), ranked[0])
        self._placing.count(hash((key, chosen.address)))
        if placed is None and chosen is ranked[0]:
            # Remembered: not a burst's overflow, which lasts until events come.
            self._placed[key] = (chosen.address, chosen.incarnation)
            self._placed.move_to_end(key)
            if len(self._placed) > REMEMBERED_KEYS:
                self._placed.popitem(last=False)
        return chosen

    def _room(self, worker: Worker, key: str, bound: int) -> bool:
        """Whether ``worker`` has room for one more request of ``key``, counting this
        replica's recent placements of the key there once for each other gateway."""
        others = worker.gateways - 1
        unseen = others * self._placing.peek(hash((key, worker.address))) if others else 0.0
        return load(worker) + 1 + unseen <= bound


class Heat:
    """Requests lately, in all and per key: counts that decay by half every
    ``half_life`` seconds, for the ``REMEMBERED_KEYS`` most recent keys."""

    def __init__(self, half_life: float = HEAT_HALF_LIFE) -> None:
        self._rate = math.log(2) / half_life
        self._counts: OrderedDict[int, tuple[float, float]] = OrderedDict()
        self._total = 0.0
        self._at = time.monotonic()

    def request(self) -> None:
        """One more request (whatever keys it is counted under)."""
        now = time.monotonic()
        self._total = self._total * math.exp(-self._rate * (now - self._at)) + 1.0
        self._at = now

    def peek(self, key: int) -> float:
        """The key's count, the request not counted under it."""
        value, at = self._counts.get(key, (0.0, 0.0))
        return value * math.exp(-self._rate * (time.monotonic() - at)) if value else 0.0

    def count(self, key: int) -> tuple[float, float]:
        """The request is counted under ``key`` too: the key's count, and its share
        of all requests."""
        now = time.monotonic()
        value, at = self._counts.pop(key, (0.0, now))
        value = value * math.exp(-self._rate * (now - at)) + 1.0
        self._counts[key] = (value, now)
        if len(self._counts) > REMEMBERED_KEYS:
            self._counts.popitem(last=False)
        return value, value / max(self._total, value)


def prompt_tokens(
    tokenizer: PromptTokenizer, kind: str, params: dict[str, Any], fresh: int | None = None
) -> tuple[Sequence[int], bool] | None:
    """The token ids the engine will compute for a request's (first) prompt, or for
    its start, tokenizing at most ``fresh`` characters not seen before; and whether
    it stops short of the whole. None where the gateway cannot tell."""
    try:
        if kind == "chat":
            messages = params.get("messages")
            if not isinstance(messages, list):
                return None
            return tokenizer.chat_ids(messages, params.get("tools"), fresh)
        if kind == "completion":
            prompt = params.get("prompt")
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a list of prompts: the first one's blocks
            if isinstance(prompt, str):
                return tokenizer.completion_ids(prompt, fresh)
            if isinstance(prompt, list) and all(type(t) is int for t in prompt):
                return prompt, False  # token ids, as the engine takes them
    # Routing must never fail a request: a prompt the gateway's renderer
    # refuses is the engine's to judge, and routed as prefix routes it.
    except Exception as exc:
        log.debug("no token ids for routing: %s", exc)
    return None
