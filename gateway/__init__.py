"""The gateway: an OpenAI-compatible HTTP front over a pool of workers.

Its own modules: the app and its lifetime (``app.py``), the server
(``main.py``), a request's typed context, errors, metrics, tracing, the
route table's endpoints and the OpenAPI document. The HTTP edge is
``api/``, where a request runs ``dispatch/``, how a client's API speaks
``dialects/``; batch jobs, the response cache, the shared state store and
per-key limits have packages of their own.
"""
