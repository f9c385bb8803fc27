"""The kv policy (gateway/dispatch/policies/kv_cache.py): a request goes to the worker
whose engine holds the most of its prompt, as the KV events say, within the load
bound; what nothing holds is placed as prefix places a key. The prompts are the
embedded model's, tokenized as a worker's tokenizer does; the events are what an
engine publishes for them."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

from gateway.dispatch.kv_index import BlockStored, EventBatch, KvIndex
from gateway.dispatch.policies import RoutingContext
from gateway.dispatch.policies.kv_cache import CacheAware
from gateway.dispatch.policies.prefix import PrefixAffinity
from gateway.dispatch.tokens import PromptTokenizer
from gateway.dispatch.work import WorkOrder
from gateway.dispatch.workers import Worker
from shared import protocol
from shared.embedded import default_model_dir

BLOCK = 16
MODEL = "m"
ADAPTER = "m-lora"
_hashes = itertools.count(1)


@pytest.fixture(scope="module")
def reference() -> Any:
    """The engine's tokenizer (Hugging Face's): what its KV events carry."""
    return AutoTokenizer.from_pretrained(str(default_model_dir()))


@pytest.fixture
def tokenizer(reference: Any) -> PromptTokenizer:
    """The gateway's, new for each test: it has tokenized no prompt yet."""
    special = {k: v for k, v in reference.special_tokens_map.items() if isinstance(v, str)}
    return PromptTokenizer(
        protocol.Tokenizer(
            model=MODEL,
            tokenizer_json=reference.backend_tokenizer.to_str(),
            chat_template=reference.chat_template,
            special_tokens=special,
        )
    )


class Fleet:
    """Workers, the index their events fill, and the policy reading both."""

    def __init__(
        self,
        tokenizer: PromptTokenizer | None,
        n: int = 3,
        block: int = BLOCK,
        reference: Any = None,
    ) -> None:
        self.workers = [
            Worker(link=SimpleNamespace(address=f"tcp://10.0.0.{i}:5550"))  # type: ignore[arg-type]
            for i in range(n)
        ]
        self.index = KvIndex()
        kv = SimpleNamespace(index=self.index, block_size=lambda address: block)
        # The adapter shares its base model's tokenizer, as its workers send it.
        tokenizers = {MODEL: tokenizer, ADAPTER: tokenizer} if tokenizer is not None else {}
        adapters = {ADAPTER: ADAPTER}
        self.policy = CacheAware(
            SimpleNamespace(kv=kv, tokenizers=tokenizers, adapters=adapters),  # type: ignore[arg-type]
            PrefixAffinity(1.25, 2),
        )
        self.reference = reference

    def cached(
        self, worker: Worker, messages: list[dict[str, Any]], lora: str | None = None
    ) -> None:
        """``worker``'s engine stored the full blocks of ``messages``' prompt (run with
        the adapter ``lora``)."""
        text = self.reference.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        tokens = self.reference(text, add_special_tokens=False)["input_ids"]
        full = len(tokens) // BLOCK * BLOCK
        hashes = [next(_hashes) for _ in range(full // BLOCK)]
        stored = BlockStored(hashes, None, tokens[:full], BLOCK, lora_name=lora)
        self.index.apply(worker.address, EventBatch(0.0, [stored]))

    def route(
        self, messages: list[dict[str, Any]], key: str | None = None, model: str = MODEL
    ) -> Worker:
        order = WorkOrder("r", "chat", model, {"messages": messages}, key=key, hinted=bool(key))
        return self.policy.select(RoutingContext(self.workers, key, model, order))


def chat(document: str, question: str) -> list[dict[str, Any]]:
    return [{"role": "system", "content": document}, {"role": "user", "content": question}]


DOC_A = " ".join(f"Alpha clause {i} says the tenant pays {i} credits." for i in range(60))
DOC_B = " ".join(f"Beta rule {i}: the operator restarts shard {i}." for i in range(60))


def test_a_documents_questions_go_to_the_worker_that_holds_it(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference)
    holder = fleet.workers[2]
    fleet.cached(holder, chat(DOC_A, "First question?"))
    fleet.workers[0].in_flight = 0
    holder.in_flight = 1  # busier, but within the bound: the cache wins
    for question in ("What does clause 7 say?", "Who pays?", "How many credits in all?"):
        assert fleet.route(chat(DOC_A, question)) is holder


def test_the_longest_cached_run_wins(tokenizer: PromptTokenizer, reference: Any) -> None:
    fleet = Fleet(tokenizer, reference=reference)
    shared_only, with_history = fleet.workers[0], fleet.workers[1]
    first = chat(DOC_A, "Summarise clause 3 in detail, please, with every number.")
    fleet.cached(shared_only, chat(DOC_A, "Something else entirely."))
    answered = [*first, {"role": "assistant", "content": "Clause 3 says the tenant pays 3."}]
    fleet.cached(with_history, answered)
    follow_up = [*answered, {"role": "user", "content": "And clause 4?"}]
    assert fleet.route(follow_up) is with_history


def test_a_prefix_every_worker_holds_goes_to_the_least_loaded(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference)
    for worker in fleet.workers:
        fleet.cached(worker, chat(DOC_A, "Warm-up."))
    loads = {fleet.workers[0]: 1, fleet.workers[1]: 0, fleet.workers[2]: 2}
    for worker, n in loads.items():
        worker.in_flight = n
    assert fleet.route(chat(DOC_A, "Hot question?")) is fleet.workers[1]


def test_the_holder_past_the_load_bound_is_passed_over(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference)
    holder = fleet.workers[0]
    fleet.cached(holder, chat(DOC_A, "First."))
    holder.in_flight = 6  # bound with 6 in flight over 3 workers: max(ceil(1.25*7/3), 3+2) = 5
    chosen = fleet.route(chat(DOC_A, "Second?"))
    assert chosen is not holder
    assert fleet.policy.affinity.bound(RoutingContext(fleet.workers)) < holder.in_flight + 1


def test_what_nothing_holds_is_placed_by_its_document(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference, n=4)
    # Before any event says where the document went, its questions land together.
    first = fleet.route(chat(DOC_B, "What restarts shard 3?"))
    first.in_flight += 1
    for question in ("And shard 9?", "Who restarts them?", "Which rule is last?"):
        assert fleet.route(chat(DOC_B, question)) is first


def test_a_client_hint_places_what_nothing_holds(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference, n=4)
    first = fleet.route(chat(DOC_A, "One?"), key="session-1")
    assert fleet.route(chat(DOC_B, "Two?"), key="session-1") is first


def test_a_restarted_worker_is_not_chosen_for_what_it_held(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference, n=2)
    restarted, other = fleet.workers
    fleet.cached(restarted, chat(DOC_A, "Early."))
    fleet.cached(other, chat(DOC_A, "Early too."))
    restarted.in_flight, other.in_flight = 0, 2
    assert fleet.route(chat(DOC_A, "Before the restart?")) is restarted  # both hold it
    # Its engine restarted: the index drops it (gateway.dispatch.kv_events).
    fleet.index.drop(restarted.address)
    restarted.incarnation = "new"
    assert fleet.route(chat(DOC_A, "After the restart?")) is other


def test_a_placement_is_kept_until_its_worker_restarts(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    # Where nothing holds a prompt, the hash of its start names a worker, the
    # same in every replica (a fresh policy over the same workers agrees).
    hashed = Fleet(tokenizer, reference=reference, n=2).route(chat(DOC_A, "Where?"))
    fleet = Fleet(tokenizer, reference=reference, n=2)
    preferred = next(w for w in fleet.workers if w.address == hashed.address)
    other = next(w for w in fleet.workers if w is not preferred)
    # That worker is past the bound (max(ceil(1.25 * 10 / 2), 5 + 2) = 7): the
    # other takes the document, and keeps it once the first has room again.
    preferred.in_flight = 9
    assert fleet.route(chat(DOC_A, "While it is full?")) is other
    preferred.in_flight = 0
    assert fleet.route(chat(DOC_A, "Once it has room?")) is other
    # The other restarts: its placement goes with it, the hash decides again.
    other.incarnation = "restarted"
    assert fleet.route(chat(DOC_A, "After the restart?")) is preferred


def test_without_a_tokenizer_it_routes_as_prefix_does() -> None:
    fleet = Fleet(None, n=4)
    prefix = PrefixAffinity(1.25, 2)
    for key in ("conversation-1", "conversation-2", "conversation-3"):
        order = WorkOrder("r", "chat", MODEL, {"messages": chat(DOC_A, key)}, key=key)
        context = RoutingContext(fleet.workers, key, MODEL, order)
        assert fleet.policy.select(context) is prefix.select(context)


def test_without_events_it_routes_as_prefix_does(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, n=4, block=0)  # no worker publishes: block size 0
    prefix = PrefixAffinity(1.25, 2)
    order = WorkOrder("r", "chat", MODEL, {"messages": chat(DOC_A, "Hi")}, key="k")
    context = RoutingContext(fleet.workers, "k", MODEL, order)
    assert fleet.policy.select(context) is prefix.select(context)


def test_a_completion_of_token_ids_is_matched_as_given(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference)
    tokens = list(range(1000, 1000 + 8 * BLOCK))
    holder = fleet.workers[1]
    stored = BlockStored([next(_hashes) for _ in range(8)], None, tokens, BLOCK)
    fleet.index.apply(holder.address, EventBatch(0.0, [stored]))
    fleet.workers[0].in_flight = 0
    holder.in_flight = 1
    order = WorkOrder("r", "completion", MODEL, {"prompt": [*tokens, 7, 8, 9]})
    assert fleet.policy.select(RoutingContext(fleet.workers, None, MODEL, order)) is holder


@pytest.mark.parametrize(
    "params",
    [
        {"messages": "not a list"},
        {"messages": [{"role": "user", "content": {"odd": "content"}}]},
        {"messages": [42]},
    ],
)
def test_a_prompt_it_cannot_render_is_routed_not_refused(
    tokenizer: PromptTokenizer, reference: Any, params: dict[str, Any]
) -> None:
    fleet = Fleet(tokenizer, reference=reference)
    order = WorkOrder("r", "chat", MODEL, params, key="k")
    assert fleet.policy.select(RoutingContext(fleet.workers, "k", MODEL, order)) in fleet.workers


def test_a_hot_prefix_spreads_where_one_document_stays(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference, n=4)
    fleet.cached(fleet.workers[0], chat(DOC_A, "Warm-up."))
    # One system prompt brings all the traffic: first requests that end at once
    # (its holder has room for them)...
    for i in range(8):
        assert fleet.route(chat(DOC_A, f"Quick question {i}?")) is fleet.workers[0]
    # ...then requests that pour in, none ending: each worker chosen computes
    # the prompt and holds it from then on.
    for i in range(12):
        messages = chat(DOC_A, f"Hot question {i}?")
        chosen = fleet.route(messages)
        chosen.in_flight += 1
        fleet.cached(chosen, messages)
    loads = sorted(w.in_flight for w in fleet.workers)
    # Spread over every worker, none more than one above another, well inside
    # the load bound (5 here) that alone would let the first holder take 5.
    assert loads[-1] - loads[0] <= 1, loads


def test_a_few_turns_of_a_conversation_do_not_count_as_hot(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference, n=4)
    home = fleet.workers[3]
    history = chat(DOC_B, "First turn.")
    for turn in range(6):
        fleet.cached(home, history)
        home.in_flight = 2  # busier than the others (other conversations), within the bound
        history = [*history, {"role": "assistant", "content": "Yes."}]
        history = [*history, {"role": "user", "content": f"Turn {turn}?"}]
        assert fleet.route(history) is home


def test_a_replica_evens_out_its_own_share_of_a_hot_prompt(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    fleet = Fleet(tokenizer, reference=reference, n=4)
    for worker in fleet.workers:
        fleet.cached(worker, chat(DOC_A, "Warm-up."))
    for i in range(8):  # the prompt turns hot
        fleet.route(chat(DOC_A, f"Quick question {i}?"))
    # The last heartbeats said worker 0 ran nothing for other replicas and
    # the rest 2 each: every replica read the same, and each would send all
    # its next requests to worker 0 if it went by that.
    for worker in fleet.workers[1:]:
        worker.others = 2
    for i in range(8):
        chosen = fleet.route(chat(DOC_A, f"Hot question {i}?"))
        chosen.in_flight += 1
    assert [w.in_flight for w in fleet.workers] == [2, 2, 2, 2]
    # A conversation's next turn behind the hot prompt holds its first turn
    # (a few blocks of its own) on worker 2: it stays there, the busiest.
    answer = "The tenant pays forty credits, as clause forty says. " * 3
    history = [*chat(DOC_A, "Hot question 0?"), {"role": "assistant", "content": answer}]
    fleet.cached(fleet.workers[2], history)
    fleet.workers[2].in_flight += 1
    follow_up = [*history, {"role": "user", "content": "And the next one?"}]
    assert fleet.route(follow_up) is fleet.workers[2]


def burst(fleet: Fleet, gateways: int, questions: list[str]) -> list[str]:
    """Where a replica sends ``questions`` on DOC_B, nothing of it held, none ending,
    its workers each serving ``gateways`` gateway processes."""
    for worker in fleet.workers:
        worker.gateways = gateways
    chosen = []
    for question in questions:
        worker = fleet.route(chat(DOC_B, question))
        worker.in_flight += 1
        chosen.append(worker.address)
    return chosen


def test_a_burst_of_a_new_prompt_behind_many_gateways_takes_one_worker_each(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    """Eight gateway processes place a prompt nothing holds on the same worker, and
    none sees the others' requests until a heartbeat: one more from this replica
    there stands for one more from each. So a burst goes one a worker, in the
    same order in every replica, until the events say who holds the prompt."""
    first = burst(Fleet(tokenizer, reference=reference, n=4), 8, [f"Q{i}?" for i in range(4)])
    assert len(set(first)) == 4, first
    # Another replica, its own requests not yet there, ranks the workers alike.
    replica = Fleet(tokenizer, reference=reference, n=4)
    assert burst(replica, 8, [f"Its question {i}?" for i in range(4)]) == first
    # Behind one gateway the burst stays together, up to the plain bound.
    alone = Fleet(tokenizer, reference=reference, n=4)
    assert len(set(burst(alone, 1, ["Alone 0?", "Alone 1?"]))) == 1


def test_an_adapters_prompt_goes_where_the_adapter_ran_it_not_the_base(
    tokenizer: PromptTokenizer, reference: Any
) -> None:
    """The same prompt under a LoRA adapter is another cached run (vLLM keys its
    blocks by the adapter): each goes to the worker that ran it so."""
    fleet = Fleet(tokenizer, reference=reference, n=3)
    base, adapted = fleet.workers[0], fleet.workers[1]
    fleet.cached(base, chat(DOC_A, "Warm-up."))
    fleet.cached(adapted, chat(DOC_A, "Warm-up."), lora=ADAPTER)
    base.in_flight = adapted.in_flight = 1  # busier than the third: the caches win
    assert fleet.route(chat(DOC_A, "Under the adapter?"), model=ADAPTER) is adapted
    assert fleet.route(chat(DOC_A, "Under the base model?")) is base
