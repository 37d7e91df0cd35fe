"""Test tooling the tests and bench/ both import: synthetic model generators (synth_gguf,
synth_lora, and llama_sdist for llama.cpp's own vocabularies and templates), the tests' models
built with them (models), the test servers (pool_server in-process; server_process as a child
process, with the fault modules it can run: hanging_runner, crashing_strategy) and their
llama.cpp thread count (threads). Never imported by the client or server packages."""
