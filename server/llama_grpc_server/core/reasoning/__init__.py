"""Reasoning: a thinking model's thinking split from its answer as it streams, which templates
think and how, and the budget that ends a thinking section. Pure Python."""
