"""URLs in logs: the password hidden, everything else as it was."""

from __future__ import annotations

import pytest

from shared.redact import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        # user and password
        ("postgresql://app:s3cret@db:5432/llmgate", "postgresql://app:***@db:5432/llmgate"),
        # a password only (Redis's AUTH)
        ("redis://:s3cret@cache:6379/0", "redis://:***@cache:6379/0"),
        ("rediss://default:s3cret@cache:6380/1", "rediss://default:***@cache:6380/1"),
        # an @ in the password (urllib's host is after the last one)
        ("postgresql://app:p@ss@db/llmgate", "postgresql://app:***@db/llmgate"),
        # a raw / or ? in the password, which SQLAlchemy reads up to the @
        ("postgresql://app:pa/ss@db/llmgate", "postgresql://app:***@db/llmgate"),
        ("postgresql://app:pa?ss@db/llmgate", "postgresql://app:***@db/llmgate"),
        # secret query parameters (libpq's password=), the others kept
        (
            "postgresql://db/llmgate?user=app&password=s3cret&sslmode=require",
            "postgresql://db/llmgate?user=app&password=***&sslmode=require",
        ),
        ("redis://:a@cache/0?token=b", "redis://:***@cache/0?token=***"),
    ],
)
def test_a_password_is_hidden(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert "s3cret" not in redact_url(url)


@pytest.mark.parametrize(
    "text",
    [
        "postgresql://app@db:5432/llmgate",  # a user, no password
        "redis://127.0.0.1:6379/0",
        "http://collector:4318/v1/traces?service=llmgate",
        "tcp://127.0.0.1:5550",
        "memory",  # not a URL
        "",
        "/var/lib/llmgate/state.db",
        "--policy=prefix",
    ],
)
def test_anything_else_is_unchanged(text: str) -> None:
    assert redact_url(text) == text


def test_an_unparsable_url_is_hidden_whole() -> None:
    assert redact_url("redis://:s3cret@[::1:6379/0") == "redis://***"
