"""The models a server serves: the pool that loads them on demand by name (pool.py), the
catalog of a models directory (catalog.py), GGUF header reading (gguf_header.py), the embedded
model's file (files.py), the trained models from the package index (trained.py: the table;
assemble.py: fetching one), `llama-grpc models` (cli.py) and the tokenizer export
(tokenizer_export.py). No grpc, no llama_cpp (models/cli.py reaches engine/ lazily to verify)."""
