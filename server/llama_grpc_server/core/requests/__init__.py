"""Requests and outputs: what a caller asked for, how it fits the context, chat values, embeddings'
parameters, and what each sampled token means."""
