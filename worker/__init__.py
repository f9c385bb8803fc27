"""The worker: one vLLM engine behind a ZeroMQ ROUTER socket, one per GPU.

Its server loop takes the gateways' requests, heartbeats and aborts
(``server.py``, ``liveness.py``) and talks to an engine through one interface
(``engine_api.py``); the vLLM engine (``engine.py``) prepares a request
(``prepare.py``, ``sampling.py``), turns vLLM's outputs into deltas
(``outputs.py``) and hands what only vLLM's own server answers to it
(``passthrough.py``, ``vllm_app.py``).
"""
