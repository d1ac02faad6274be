"""The builtin reference engine: a small, exact, pure-PyTorch vLLM-v1-style engine (docs/design.md, "What it is",
"Runner semantics").

`config` (knobs, vLLM's names) -> `request`, `kv_cache_manager`, `scheduler` (what runs each step) ->
`weights`, `model`, `attention`, `tokenizer` (the model) -> `sampler`, `grammar`, `runner` (one step, with vLLM's
runner semantics) -> `engine` (the step loop that hands every step to its listeners).
"""
