"""The gateway's Prometheus page."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway import metrics


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
