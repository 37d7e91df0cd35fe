"""The only package importing llama_cpp: model, context, batch, samplers, runner."""
