"""Tools: what a chat request offers (`ToolSpec`), how the model's answer becomes tool calls
(one streaming parser per format, `formats/`), and how `tool_choice` constrains the answer.
Pure Python: no llama_cpp, no grpc."""
