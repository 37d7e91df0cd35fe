"""llama_grpc.v1's LlmService: its handlers, its requests checked, its messages built."""
