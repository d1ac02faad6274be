"""replay: a record-and-replay debugger for LLM inference engines that speak vLLM's v1 data contracts."""

__version__ = "0.1.0"
