"""``python -m serve``: ``llmgate serve``."""

from serve.main import main

main()
