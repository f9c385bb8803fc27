"""URLs fit for a log: the password hidden, the rest kept.

``redact_url("postgresql://app:pw@db:5432/llmgate")`` is
``postgresql://app:***@db:5432/llmgate``, ``redis://:pw@cache:6379/0`` is
``redis://:***@cache:6379/0``, and a secret query parameter
(``?password=pw``) is hidden the same way. Anything else (no password, not
a URL: ``memory``, a path) comes back unchanged. Every log line and message
that shows a setting's URL (the state store's, a Redis's, the collector's, a
child's command line) goes through ``redact_url``.
"""

from __future__ import annotations

import re
from urllib.parse import unquote_plus, urlsplit

HIDDEN = "***"

# Query parameters whose values are secrets (libpq takes ``password``).
SECRET_PARAMETERS = frozenset(
    {"password", "pass", "passwd", "pwd", "sslpassword", "secret", "token", "access_token"}
    | {"api_key", "apikey"}
)

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# ``scheme://user:PASSWORD@``, for the passwords urllib cannot see: one with
# a raw ``/``, ``?`` or ``#`` ends urllib's host part early, where SQLAlchemy
# (--state-db) reads it up to the ``@``. Hiding too much beats too little.
_RAW_USERINFO = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^:/@?#]*):[^@]*[/?#][^@]*@")


def redact_url(url: str) -> str:
    """``url`` with its password, and the values of ``SECRET_PARAMETERS``, as ``***``."""
    if not _SCHEME.match(url):
        return url
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:  # an unparsable URL (a bad IPv6 host): show no part of it
        return f"{url.split('://', 1)[0]}://{HIDDEN}"
    if password is not None:
        userinfo, _, host = parts.netloc.rpartition("@")
        user = userinfo.partition(":")[0]
        url = url.replace(f"//{parts.netloc}", f"//{user}:{HIDDEN}@{host}", 1)
    elif raw := _RAW_USERINFO.match(url):
        url = f"{raw['head']}:{HIDDEN}@{url[raw.end() :]}"
    if parts.query:
        url = _redact_query(url, parts.query)
    return url


def _redact_query(url: str, query: str) -> str:
    kept = []
    for pair in query.split("&"):
        name, eq, _value = pair.partition("=")
        secret = eq and unquote_plus(name).lower() in SECRET_PARAMETERS
        kept.append(f"{name}={HIDDEN}" if secret else pair)
    return url.replace(f"?{query}", f"?{'&'.join(kept)}", 1)
