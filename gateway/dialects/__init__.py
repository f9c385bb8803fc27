"""Dialects: how a client's API speaks, with no knowledge of where a request runs.

Request bodies (``schemas.py``), OpenAI's SSE and whole JSON answers
(``sse.py``), TGI's (``tgi.py``) and the one JSON encoder (``jsonresp.py``).
An import-linter contract keeps ``gateway.dispatch`` out.
"""
