"""``llmgate serve``: plans the workers and the gateway, starts them and supervises them.

Not the worker (``worker/``) nor the gateway (``gateway/``): it starts both.
"""
