"""The measuring tools: ``make bench``, ``make bench-overhead``, ``make bench-scaling``, ``make loadtest``.

Each starts its servers, runs its load and writes its figures under
``loadtest/results/``; ``fake_engine.py`` is the benchmark and
fault-injection double (never a stand-in for vLLM in a feature test).
"""
