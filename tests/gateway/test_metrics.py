"""The gateway's Prometheus page."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway import metrics
from shared.protocol import Usage


def test_every_batch_line_status_shows_at_zero_before_any_line_ran() -> None:
    """A replica that ran no line of a job says 0, not nothing: a dashboard's
    sum over replicas, or a test reading one replica, needs the sample."""
    text = metrics.render()[0].decode()
    statuses = {
        sample.labels["status"]
        for family in text_string_to_metric_families(text)
        if family.name == "llmgate_batch_lines"
        for sample in family.samples
        if sample.name == "llmgate_batch_lines_total"
    }
    assert statuses == {"completed", "failed", "cancelled", "expired"}


def sample(text: str, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return 0.0


def test_what_the_request_path_counts_is_on_the_page_it_renders() -> None:
    """Counts are summed in memory and written out in batches; the page a
    scrape gets includes every one of them, and each is written once."""
    model, route, key = "metrics-test-model", "/v1/completions", "metrics-test-key"
    before = metrics.render()[0].decode()
    metrics.finished(model, route, "200", key, Usage(7, 3))
    metrics.finished(model, route, "200", key, Usage(5, 0), cached=True)
    metrics.finished(model, route, "499", key, None)
    metrics.add(metrics.IN_FLIGHT)
    metrics.add(metrics.IN_FLIGHT)
    metrics.add(metrics.IN_FLIGHT, -1)
    after = metrics.render()[0].decode()
    again = metrics.render()[0].decode()

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("llmgate_requests_total", model=model, route=route, status="200") == 2
    assert moved("llmgate_requests_total", model=model, route=route, status="499") == 1
    assert moved("llmgate_key_requests_total", key=key, status="200") == 2
    # The engine computed the first request's tokens, not the cache hit's.
    assert moved("llmgate_prompt_tokens_total", model=model) == 7
    assert moved("llmgate_generation_tokens_total", model=model) == 3
    # The key used both, the hit's as cached tokens too.
    assert moved("llmgate_key_tokens_total", key=key, type="prompt") == 12
    assert moved("llmgate_key_tokens_total", key=key, type="completion") == 3
    assert moved("llmgate_key_tokens_total", key=key, type="cached") == 5
    assert moved("llmgate_requests_in_flight") == 1
    # Written once: a second page says the same (of these; the process's own
    # CPU and collector samples move on their own).
    for name, labels in [
        ("llmgate_requests_total", {"model": model, "route": route, "status": "200"}),
        ("llmgate_key_tokens_total", {"key": key, "type": "prompt"}),
        ("llmgate_requests_in_flight", {}),
    ]:
        assert sample(again, name, **labels) == sample(after, name, **labels)
