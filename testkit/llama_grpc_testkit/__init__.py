"""Test tooling the tests and bench/ both import: synthetic model generators (synth_gguf,
synth_lora, and llama_sdist for llama.cpp's own vocabularies and templates) and the test servers
(in-process and as child processes). Never imported by the client or server packages."""
