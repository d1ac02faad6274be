"""What tests and benchmarks build on, shared by both: tiny random-weight checkpoints written with `transformers`
(`checkpoints`; nothing is downloaded), logit rows shaped as a trained model's (`logits`) and recordings of real
vLLM runs (`vllm_record`). Imported from the repository's root (pytest, `python -m bench.NAME`); not part of the
installed package."""
