"""vLLM engine arguments given by name: `replay record --vllm-arg NAME=VALUE` and a replay's `--set vllm.NAME=VALUE`.
Each name is checked against the installed vLLM's `EngineArgs` (one line naming the nearest ones); a replay also
refuses those the recorded steps fix."""

from __future__ import annotations

import dataclasses
import difflib
import json
from typing import Any

from replay.errors import UsageError
from replay.integrations.vllm.layout import engine_args

# engine arguments the recorded steps fix: the block tables, batch rows and positions they hold are the recording's
RECORDED_ARGS = {"block_size": "KV block tables", "num_gpu_blocks_override": "KV block tables",
                 "max_num_seqs": "batches (its rows hold them)", "max_num_batched_tokens": "steps (their token counts)",
                 "max_model_len": "sequence lengths", "skip_tokenizer_init": "token ids",
                 "async_scheduling": "steps (one after the other)", "model": "weights (--set model=PATH moves them)"}


def check_names(names: list[str], flag: str) -> None:
    """Raises UsageError for the first of `names` this vLLM's engine does not take: `flag` and the name, the version,
    and the nearest names it does take."""
    import vllm
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for name in names:
        if name not in known:
            near = difflib.get_close_matches(name, known, n=3)
            raise UsageError(f"{flag}{name}: vLLM {vllm.__version__}'s engine has no argument {name!r}"
                             + (f" (did you mean {', '.join(near)}?)" if near else ""))


def arg_value(text: str) -> Any:
    """An engine argument's value from its text: a number, true/false/none, JSON for a dict or a list, else text."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    low = text.lower()
    if low in ("true", "false", "none", "null"):
        return {"true": True, "false": False}.get(low)
    if text[:1] in "{[":
        try:
            return json.loads(text)
        except ValueError:
            raise UsageError(f"--set vllm.ARG={text}: not valid JSON") from None
    return text


def checked_engine_args(overrides: dict[str, str]) -> dict[str, Any]:
    """A replay's `vllm.ARG` knobs as `LLM` keyword arguments: each one this vLLM's engine takes, and none that the
    recorded steps fix (else a UsageError naming it)."""
    args = engine_args(overrides)
    check_names(list(args), "--set vllm.")
    fixed = [a for a in args if a in RECORDED_ARGS]
    if fixed:
        raise UsageError(f"--set vllm.{fixed[0]}: a replay runs the recorded steps on the recorded "
                         f"{RECORDED_ARGS[fixed[0]]}; it cannot change (record again with it)")
    return {k: arg_value(v) for k, v in args.items()}
