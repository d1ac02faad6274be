"""vLLM integration: a `vllm.general_plugins` tap (`plugin`), vLLM objects <-> contracts (`convert`)."""
