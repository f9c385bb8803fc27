"""The HTTP edge: every route's endpoint, and one request's way from its body to its answer.

Request ids and API keys first, the POST routes served straight from ASGI
(``direct.py``), a request's ``Call`` (limits, the response cache, its
attempts on workers, the streamed or whole answer, its settlement), and
each API's endpoint table (``*_routes.py``, wired in ``gateway.app``).
"""
