"""Dispatch: getting a request to an engine and its answer back.

The pool (``pool.py``) is the API's one door: admission and its slots,
fair sharing between keys, the routing policies, the workers and their
liveness, discovery, the ZeroMQ links, a request's handle, the models and
pools a name resolves to, and the cascade. It knows nothing of HTTP or of
the API's dialects (an import-linter contract keeps ``gateway.api`` out).
"""
