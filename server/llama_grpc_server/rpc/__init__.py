"""The gRPC layer, in three rooms: plumbing/ (the server's wiring, lifecycle, interceptors,
access, TLS, health and status mapping), v1/ (llama_grpc.v1's LlmService) and vllm/ (the vLLM
engine protocol), with shared/ holding what both protocols use (running a request, checked
parameters, deadlines, tokenizing, thinking). v1 and vllm never import each other
(tests/unit/project/test_boundaries.py checks). Imports grpc and core/; never llama_cpp (the
engine is reached only through core.api.EngineApi)."""
