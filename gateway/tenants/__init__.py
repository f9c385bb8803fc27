"""Tenants: what a request's API key may do, enforced across every gateway process.

``limits`` (the front door: :class:`Limiter`, the request path's ``admit``
and ``settle``, the ``x-ratelimit-*`` headers), ``windows`` (the GCRA
arithmetic and the per-process store), ``redis_limits`` (the same in Lua,
shared through Redis).
"""

from __future__ import annotations

from gateway.tenants.limits import Limiter, LimitScope, admit, settle

__all__ = ["LimitScope", "Limiter", "admit", "settle"]
