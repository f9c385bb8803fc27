"""worker/vllm_app.py's ``with_priority``: a body answered by vLLM's own server code runs
at its band's priority or later, never sooner, whatever ``priority`` field it carries."""

from __future__ import annotations

from typing import Any

import pytest

from shared import protocol
from worker.vllm_app import with_priority


@pytest.mark.parametrize(
    ("body", "band", "runs_at"),
    [
        ({"prompt": "x"}, protocol.INTERACTIVE, None),  # nothing to add
        ({"prompt": "x"}, protocol.BATCH, protocol.BATCH),
        ({"priority": -100}, protocol.BATCH, protocol.BATCH),  # no jumping the queue
        ({"priority": -100}, protocol.INTERACTIVE, protocol.INTERACTIVE),
        ({"priority": 7}, protocol.STANDARD, 7),  # later is the client's to ask
        ({"priority": "soon"}, protocol.BATCH, "soon"),  # vLLM refuses it (400)
    ],
)
def test_a_body_runs_at_its_band_or_later(body: dict[str, Any], band: int, runs_at: Any) -> None:
    assert with_priority(body, band).get("priority") == runs_at


def test_a_body_that_is_no_object_is_left_alone() -> None:
    assert with_priority(None, protocol.BATCH) is None
    assert with_priority([1], protocol.BATCH) == [1]
