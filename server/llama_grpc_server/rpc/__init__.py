"""The gRPC layer: grpc.aio server, servicer, validation, conversion, status mapping, interceptors.
Imports grpc and core/; never llama_cpp (the engine is reached only through core.api.EngineApi)."""
