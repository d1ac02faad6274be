"""Fields an engine sends that a capture does not keep, and which of them matter.

The vLLM tap records, in the capture header (`extra["vllm_unmirrored_fields"]`), every field of vLLM's contract
classes that ours have no place for: each vLLM version adds some. Most carry nothing a step's numerics or a replay
depend on (the detokenizer's and the stream's settings, a tensor copy of a list we keep); the others are named when
recording starts and by `replay info`, so that nothing is dropped in silence.
"""

from __future__ import annotations

# "Class.field": nothing a replay or a diff depends on
NOT_NEEDED = frozenset({
    "LogprobsTensors.cu_num_generated_tokens_tensor",  # a tensor copy of cu_num_generated_tokens, which we keep
    "SamplingParams.output_text_buffer_length",  # the detokenizer's
    "SamplingParams.skip_clone",  # how vLLM copies the params
    "SamplingParams.stream_interval",  # how often a stream is flushed
    "SamplingParams.trace_decode_token_ids",  # tracing
    "EngineCoreRequest.session_id",  # the front end's session
})


def unkept(unmirrored: dict[str, list[str]] | None) -> list[str]:
    """"Class.field" of every field an engine sent that a capture does not keep and that may matter."""
    return [f"{cls}.{name}" for cls, names in (unmirrored or {}).items() for name in names
            if f"{cls}.{name}" not in NOT_NEEDED]
