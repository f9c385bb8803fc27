"""Span extraction: JSON whose marked string values are verbatim spans of a source text.

Two schema extensions, applied on the worker beside the tokenizer:

* ``"x-span": true`` on a string property: its value is a substring of the
  source, enforced while decoding by a grammar (``grammar.py``, built on the
  source's suffix automaton in ``automaton.py``);
* ``"x-key-prompt"``: a key carries an instruction while the model writes
  and is plain again in what the client reads (``key_prompts.py``).

``schema.py`` walks a schema once for both; ``request.py`` finds the schema
in a request body and puts back what vLLM runs (:func:`apply`).
"""

from __future__ import annotations

from worker.json_spans.key_prompts import KeyRewriter
from worker.json_spans.request import Applied, apply
from worker.json_spans.schema import SpanPlan, plan_schema

__all__ = ["Applied", "KeyRewriter", "SpanPlan", "apply", "plan_schema"]
