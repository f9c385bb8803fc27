"""The error tree maps onto OpenAI's error JSON and the right status codes."""

from __future__ import annotations

import pytest

from gateway import errors


@pytest.mark.parametrize(
    "status, cls",
    [
        (400, errors.BadRequest),
        (413, errors.PayloadTooLarge),
        (429, errors.Overloaded),
        (502, errors.UpstreamFailed),
        (503, errors.NoWorker),
        (504, errors.Timeout),
        (418, errors.BadRequest),
        (500, errors.GatewayError),
    ],
)
def test_worker_failures_map_to_the_error_for_their_status(status: int, cls: type) -> None:
    error = errors.from_status(status, "message")
    assert type(error) is cls


def test_404_is_model_not_found_only_for_the_model_param() -> None:
    assert isinstance(errors.from_status(404, "x", "model"), errors.ModelNotFound)
    assert type(errors.from_status(404, "x")) is errors.NotFound


def test_body_is_openai_shaped() -> None:
    error = errors.ModelNotFound.for_model("gpt-9")
    body = error.body()
    assert body == {
        "error": {
            "message": "The model `gpt-9` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    assert error.status == 404


def test_overloaded_says_when_to_retry() -> None:
    error = errors.Overloaded("busy", retry_after=3)
    assert error.status == 429 and error.headers() == {"Retry-After": "3"}


def test_a_model_not_ready_is_a_503_that_says_when_to_retry() -> None:
    error = errors.ModelNotReady.for_model("m", served_before=False)
    assert error.status == 503
    assert error.headers() == {"Retry-After": str(errors.NO_WORKER_RETRY_AFTER)}
    body = error.body()["error"]
    assert body["code"] == "model_not_ready" and body["param"] == "model"
    assert body["type"] == "service_unavailable"
    assert "starting" in body["message"]
    assert "down" in errors.ModelNotReady.for_model("m", served_before=True).message


def test_every_503_for_want_of_a_worker_says_when_to_retry_unless_told_not_to() -> None:
    assert "Retry-After" in errors.NoWorker("none").headers()
    assert "Retry-After" in errors.from_status(503, "draining").headers()
    assert errors.NoWorker("broken", retry_after=None).headers() == {}
