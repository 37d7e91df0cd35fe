"""The vLLM engine protocol (`vllm.grpc.engine.VllmEngine`, the SMG gateway's): its handlers,
its requests checked, its messages built. Never imports llama_grpc.v1 or rpc/v1."""
