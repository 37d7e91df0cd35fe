"""What both protocols use, protocol-neutral: running a request against the pool, checked
parameters and their ranges, deadlines, tokenizing, thinking. Imports neither rpc/v1 nor rpc/vllm,
nor either protocol's generated messages (tests/unit/project/test_boundaries.py checks)."""
