"""Pure scheduling logic. Never imports llama_cpp or grpc (tests/unit/test_boundaries.py checks)."""
