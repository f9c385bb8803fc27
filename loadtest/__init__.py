"""The measuring tools: make bench, bench-overhead, bench-scaling and loadtest.

Each starts its servers, runs its load and writes its figures under
``loadtest/results/``; ``fake_engine.py`` is the benchmark and
fault-injection double (never a stand-in for vLLM in a feature test).
"""
