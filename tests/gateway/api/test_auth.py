"""API keys: loading them, and the middleware's answer to each kind of header."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api.auth import ApiKeyMiddleware, KeyRing, load_api_keys
from gateway.context import context_of
from shared import api_keys
from shared.api_keys import sha256_hex
from shared.settings import TenantSettings

KEYS = ["k1", "sk-second-key"]


async def _ok_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The app behind the middleware: 200 "ok" on any path."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _client(keys: KeyRing | list[str] = KEYS) -> httpx.AsyncClient:
    app = ApiKeyMiddleware(_ok_app, keys)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def _get(
    path: str, headers: dict[str, str], keys: KeyRing | list[str] = KEYS
) -> httpx.Response:
    async with _client(keys) as client:
        return await client.get(path, headers=headers)


# -- loading keys -------------------------------------------------------------


def test_keys_come_from_the_flag_and_the_file(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# team a\nfile-key-1\n\n  file-key-2  # rotated in May\n")
    loaded = load_api_keys(TenantSettings(api_keys=" a, b ,,", api_keys_file=str(keys_file)))
    assert [entry.key_sha256 for entry in loaded] == [
        sha256_hex(key) for key in ["a", "b", "file-key-1", "file-key-2"]
    ]
    # Named by their hashes' first digits: stable, and no use to anyone who reads them.
    assert [entry.name for entry in loaded][:2] == [f"key-{sha256_hex(k)[:8]}" for k in "ab"]


def test_no_keys_means_no_authentication() -> None:
    assert load_api_keys(TenantSettings()) == []


def test_a_keys_file_without_keys_is_an_error_not_an_open_gateway(tmp_path: Path) -> None:
    keys_file = tmp_path / "keys"
    keys_file.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        load_api_keys(TenantSettings(api_keys_file=str(keys_file)))


def test_a_missing_keys_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        load_api_keys(TenantSettings(api_keys_file=str(tmp_path / "absent")))


def test_a_bad_key_is_refused_without_quoting_it() -> None:
    with pytest.raises(ValueError) as raised:
        load_api_keys(TenantSettings(api_keys="good,secret\tvalue"))
    assert "secret" not in str(raised.value)


# -- the middleware -----------------------------------------------------------


@pytest.mark.parametrize("key", KEYS)
async def test_every_configured_key_is_let_in(key: str) -> None:
    response = await _get("/v1/models", {"Authorization": f"Bearer {key}"})
    assert response.status_code == 200 and response.text == "ok"


async def test_the_scheme_is_case_insensitive_and_spaces_are_trimmed() -> None:
    response = await _get("/v1/models", {"Authorization": "  bearer   k1  "})
    assert response.status_code == 200


async def test_a_missing_key_is_401_in_openai_shape() -> None:
    response = await _get("/v1/chat/completions", {})
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_api_key"
    assert error["param"] is None
    assert "didn't provide an API key" in error["message"]


@pytest.mark.parametrize(
    "authorization",
    [
        "Bearer wrong",
        "Bearer k1x",  # a configured key's prefix or extension is not the key
        "Bearer k",
        "Bearer",
        "Bearer ",
        "Basic azE6",
        "k1",
        "Bearer k1,sk-second-key",
    ],
)
async def test_a_wrong_key_is_401_and_not_echoed(authorization: str) -> None:
    response = await _get("/v1/completions", {"Authorization": authorization})
    assert response.status_code == 401
    error = response.json()["error"]
    assert error["code"] == "invalid_api_key"
    token = authorization.partition(" ")[2].strip()
    if len(token) > 3:  # shorter ones occur in the message's own words
        assert token not in response.text


async def test_unknown_paths_need_a_key_too() -> None:
    assert (await _get("/no/such/route", {})).status_code == 401


@pytest.mark.parametrize("path", ["/health", "/ready"])
async def test_probes_are_open(path: str) -> None:
    assert (await _get(path, {})).status_code == 200


async def test_metrics_are_for_admin_keys_only(tmp_path: Path) -> None:
    """Per-key usage is in /metrics: no caller but an operator's key may read it
    (it was open to anyone unless --protect-metrics, and to any key with it)."""
    path = tmp_path / "keys.yaml"
    team = api_keys.add(path, "team-a")
    ops = api_keys.add(path, "ops", admin=True)
    ring = KeyRing(TenantSettings(api_keys_file=str(path)))
    anonymous = await _get("/metrics", {}, ring)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "invalid_api_key"
    refused = await _get("/metrics", {"Authorization": f"Bearer {team}"}, ring)
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", None)
    assert "admin" in error["message"]
    assert (await _get("/metrics", {"Authorization": f"Bearer {ops}"}, ring)).status_code == 200
    # Every other route takes any key, and the probes none.
    assert (await _get("/v1/models", {"Authorization": f"Bearer {team}"}, ring)).status_code == 200
    assert (await _get("/health", {}, ring)).status_code == 200
    assert (await _get("/ready", {}, ring)).status_code == 200


async def test_a_rejected_request_body_is_never_read() -> None:
    """Auth runs before the app: an unauthenticated client cannot make us read its body."""
    reads = 0

    async def receive() -> dict[str, Any]:
        nonlocal reads
        reads += 1
        return {"type": "http.request", "body": b"x" * 1024, "more_body": True}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": [], "method": "POST"}
    await ApiKeyMiddleware(_ok_app, KEYS)(scope, receive, send)
    assert reads == 0
    assert sent[0]["status"] == 401


async def test_lifespan_events_pass_through() -> None:
    seen: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    await ApiKeyMiddleware(app, KEYS)({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan"]


def test_the_middleware_needs_a_key() -> None:
    with pytest.raises(ValueError):
        ApiKeyMiddleware(_ok_app, [])


_SPACES = st.text(alphabet=" ", min_size=0, max_size=3).map(str.encode)
_VALID = st.builds(
    lambda lead, scheme, gap, key, tail: lead + scheme + b" " + gap + key + tail,
    _SPACES,
    st.sampled_from([b"Bearer", b"bearer", b"BEARER", b"bEaReR"]),
    _SPACES,
    st.sampled_from([key.encode() for key in KEYS]),
    _SPACES,
)
# Near misses: a valid header with one byte changed, dropped or added.
_MUTATED = st.tuples(_VALID, st.integers(0, 40), st.binary(min_size=0, max_size=1)).map(
    lambda t: t[0][: t[1]] + t[2] + t[0][t[1] + 1 :]
)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.one_of(st.binary(max_size=200), _VALID, _MUTATED), max_size=3),
    name=st.sampled_from([b"authorization", b"x-api-key"]),
)
def test_any_raw_header_gets_200_or_401_and_only_a_real_key_gets_in(
    values: list[bytes], name: bytes
) -> None:
    """Raw ASGI headers, below what an HTTP client would send: never an exception."""
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    headers = [(name, value) for value in values]
    scope = {"type": "http", "path": "/v1/models", "headers": headers}
    asyncio.run(ApiKeyMiddleware(_ok_app, KEYS)(scope, receive, send))
    status = sent[0]["status"]
    first = values[0] if values and name == b"authorization" else None
    if first is None:
        assert status == 401
        return
    scheme, _, token = first.strip().partition(b" ")
    real_key = scheme.lower() == b"bearer" and token.strip() in {k.encode() for k in KEYS}
    assert status == (200 if real_key else 401)
    if status == 401:
        assert json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"


# -- the keys file, re-read -------------------------------------------------------


def test_a_key_added_or_revoked_in_the_file_counts_after_the_next_look(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.api import auth
    from shared import api_keys

    path = tmp_path / "keys.yaml"
    first = api_keys.add(path, "a")
    ring = auth.KeyRing(TenantSettings(api_keys_file=str(path)))
    entry = ring.match(first.encode())
    assert entry is not None and entry.name == "a"
    second = api_keys.add(path, "b", requests_per_minute=5)
    api_keys.revoke(path, "a")
    monkeypatch.setattr(auth, "RELOAD_SECONDS", 0.0)
    ring.refresh()
    assert ring.match(first.encode()) is None
    entry = ring.match(second.encode())
    assert entry is not None and entry.requests_per_minute == 5
    # A file that stops loading keeps the keys it had.
    path.write_text("keys:\n  - name: broken\n")
    ring.refresh()
    assert ring.match(second.encode()) is not None


async def test_the_matching_key_is_in_the_scope_for_what_comes_after() -> None:
    seen: list[object] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(context_of(scope).key)
        await _ok_app(scope, receive, send)

    middleware = ApiKeyMiddleware(app, ["k1", "k2"])
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(middleware), base_url="http://t"
    ) as client:
        response = await client.get("/v1/models", headers={"Authorization": "Bearer k2"})
    assert response.status_code == 200
    assert [getattr(entry, "key_sha256", None) for entry in seen] == [sha256_hex("k2")]


# -- who owns what a request makes: the key's id, never its name ---------------------


@pytest.mark.parametrize(
    ("entry", "clash"),
    [
        (f"name: key-{sha256_hex('sk-flag')[:8]}", "name"),
        (f"name: team-a\n    id: key_{sha256_hex('sk-flag')[:16]}", "id"),
    ],
)
def test_a_name_or_id_of_a_flag_key_given_again_in_the_file_is_refused(
    tmp_path: Path, entry: str, clash: str
) -> None:
    """Two keys with one name or id would own, or show as, each other's."""
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - {entry}\n    key: sk-other\n")
    with pytest.raises(ValueError, match=f"the {clash} .* --api-keys and --api-keys-file"):
        load_api_keys(TenantSettings(api_keys="sk-flag", api_keys_file=str(path)))


def test_the_ring_finds_a_key_by_its_id_as_the_file_is_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.api import auth

    path = tmp_path / "keys.yaml"
    api_keys.add(path, "spare")
    api_keys.add(path, "team-a")
    ring = KeyRing(TenantSettings(api_keys_file=str(path)))
    old = api_keys.load(path)[1]
    found = ring.with_id(old.id)
    assert found is not None and found.name == "team-a"
    api_keys.revoke(path, "team-a")
    api_keys.add(path, "team-a")  # the same name, a new secret: another key
    monkeypatch.setattr(auth, "RELOAD_SECONDS", 0.0)
    assert ring.with_id(old.id) is None
    new = ring.with_id(api_keys.load(path)[1].id)
    assert new is not None and new.name == "team-a"
