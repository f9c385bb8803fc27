"""Baselines ``make bench`` compares llmgate against, written as their authors would."""
