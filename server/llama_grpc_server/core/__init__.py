"""Pure scheduling logic. Never imports llama_cpp or grpc (tests/unit/project/test_boundaries.py
checks)."""
