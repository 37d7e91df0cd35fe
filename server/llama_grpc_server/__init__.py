"""llama-grpc server: a grpc.aio service over one continuous-batching llama.cpp engine."""

__version__ = "0.1.0"
