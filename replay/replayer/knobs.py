"""`--set KNOB=VALUE`: the knobs a replay can change, parsed and checked in one place.

Three kinds, by name:
- ours: `dtype`, `attention`, `threads`, `device`, `model`, `seed`, `batch_invariant`, `runner`, and vLLM's layout
  knobs (`tensor_parallel_size`, `enforce_eager`, ...: `replay.integrations.vllm.layout`);
- `vllm.ARG=VALUE`: any vLLM engine argument (vLLM's `EngineArgs` names), for vLLM's runner;
- `env.NAME=VALUE`: an environment variable, set before the runner starts and seen by every worker it starts (the
  replay runs in a fresh process: `replay.processes.in_environment`); `env.NAME=` unsets it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from replay.engine.config import DTYPES
from replay.errors import UsageError
from replay.integrations.vllm.layout import ENGINE_ARG, LAYOUT_KNOBS, check_layout_knob

KNOBS = ("dtype", "attention", "threads", "device", "model", "seed", "batch_invariant", "runner") + LAYOUT_KNOBS
RUNNERS = ("builtin", "vllm")
# what vLLM-runner replay can change: the dtype, the weights, and the layout vLLM runs them on (vLLM's names), plus
# any engine argument and environment variable
VLLM_KNOBS = ("dtype", "model", "runner") + LAYOUT_KNOBS
BOOLEANS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}
ENV = "env."
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ARG_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def parse_overrides(items: list[str] | None, flag: str = "--set") -> dict[str, str]:
    """`["dtype=bfloat16", "env.MKL_CBWR=COMPATIBLE", ...]` -> {"dtype": "bfloat16", ...}; an unknown knob, a bad
    value, or a knob the chosen runner cannot apply is a usage error that names it (as given to `flag`)."""
    try:
        return _parse(items)
    except UsageError as e:
        if flag == "--set" or not str(e).startswith("--set "):
            raise
        raise UsageError(flag + str(e)[len("--set"):]) from None


def _parse(items: list[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip()
        if key.startswith(ENV):
            if not sep or not _ENV_NAME.fullmatch(key[len(ENV):]):
                raise UsageError(f"--set {item!r}: expected env.NAME=VALUE (env.NAME= unsets it)")
            out[key] = value
            continue
        key = key.replace("-", "_")
        if key.startswith(ENGINE_ARG):
            arg = key[len(ENGINE_ARG):]
            if not sep or not value or not _ARG_NAME.fullmatch(arg):
                raise UsageError(f"--set {item!r}: expected vllm.ARG=VALUE, ARG an engine argument by vLLM's name")
            key = arg if arg in VLLM_KNOBS else key  # vllm.tensor_parallel_size is the layout knob
        if key == "attention_impl":
            key = "attention"
        if not sep or not value:
            raise UsageError(f"--set {item!r}: expected KNOB=VALUE")
        if key not in KNOBS and not key.startswith(ENGINE_ARG):
            raise UsageError(f"--set {item!r}: unknown knob {key!r}; knobs are {', '.join(KNOBS)}, vllm.ARG (any vLLM "
                             "engine argument) and env.NAME (an environment variable)")
        out[key] = _checked(key, value.strip())
    _check_runner(out)
    return out


Knobs = Mapping[str, object] | str | Iterable[str]  # {"dtype": "bfloat16"}, "dtype=bfloat16,threads=2", [...]


def check_overrides(overrides: Knobs | None, runner: str | None = None) -> dict[str, str]:
    """Knobs given from Python, checked and normalised as `--set` does them: a dict ({"dtype": "bfloat16",
    "threads": 2}), a "K=V,K=V" string or a list of "K=V". `runner` ("builtin" or "vllm") is the `runner` knob,
    refused where the knobs name another."""
    if overrides is None:
        items: list[str] = []
    elif isinstance(overrides, str):
        items = split_knobs(overrides)
    elif isinstance(overrides, Mapping):
        items = [f"{k}={'' if v is None else v}" for k, v in overrides.items()]
    else:
        items = list(overrides)
    return parse_overrides(with_runner(items, runner))


def with_runner(items: list[str], runner: str | None,
                said_as: str = "runner={runner!r} and the knob runner={said}") -> list[str]:
    """Knobs ("K=V") with `runner` ("builtin" or "vllm", where given) as the runner knob; a runner knob among them
    that names another runner is refused, in `said_as`'s words (the CLI's name its flags)."""
    if runner is None:
        return items
    if runner not in RUNNERS:
        raise UsageError(f"runner {runner!r}: expected {' or '.join(RUNNERS)}")
    said = [x.partition("=")[2].strip() for x in items if x.partition("=")[0].strip() == "runner"]
    if any(v != runner for v in said):
        raise UsageError(f"{said_as.format(runner=runner, said=said[0])} say two things: keep one")
    return items if runner == "builtin" else [*items, f"runner={runner}"]  # (builtin: the default, no knob)


VLLM_DTYPES = ("float32", "bfloat16", "float16", "float", "half", "auto")  # vLLM's `ModelDType`


def _checked(key: str, value: str) -> str:
    """`value` of our own knob `key`, checked and normalised."""
    if key == "threads" and not (value.isdigit() and int(value) >= 1):
        raise UsageError(f"--set threads={value}: expected a positive integer")
    if key == "seed" and not value.isdigit():
        raise UsageError(f"--set seed={value}: expected a non-negative integer")
    if key in ("batch_invariant", "enforce_eager") and value.lower() not in BOOLEANS:
        raise UsageError(f"--set {key}={value}: expected true or false")
    if key == "runner" and value not in RUNNERS:
        raise UsageError(f"--set runner={value}: expected builtin or vllm")
    if key in LAYOUT_KNOBS:
        try:
            return check_layout_knob(key, value)
        except ValueError as e:
            raise UsageError(f"--set {key}={value}: {e}") from None
    return value


def _check_runner(out: dict[str, str]) -> None:
    """Refuse, in one line naming the knob and the runner, what the chosen runner cannot apply."""
    dtypes = VLLM_DTYPES if out.get("runner") == "vllm" else DTYPES
    if "dtype" in out and out["dtype"] not in dtypes:
        raise UsageError(f"--set dtype={out['dtype']}: expected one of {', '.join(dtypes)} on the "
                         f"{out.get('runner', 'builtin')} runner")
    layout = [k for k in out if k in LAYOUT_KNOBS]
    if layout and out.get("runner") != "vllm":
        raise UsageError(f"--set {', '.join(layout)}: a vLLM layout knob; it needs vLLM's runner (--runner vllm): the "
                         "builtin runner computes on one worker, in eager mode, with its own attention")
    args = [k for k in out if k.startswith(ENGINE_ARG)]
    if args and out.get("runner") != "vllm":
        raise UsageError(f"--set {', '.join(args)}: a vLLM engine argument; the builtin runner cannot apply it "
                         "(--runner vllm replays on vLLM's own runner, which can)")
    if out.get("runner") == "vllm":
        builtin_only = [k for k in out if k not in VLLM_KNOBS and not k.startswith((ENGINE_ARG, ENV))]
        if builtin_only:
            raise UsageError(f"--set {', '.join(builtin_only)}: builtin runner only (vLLM's runner picks its own "
                             f"kernels and threads); with runner=vllm the knobs are {', '.join(VLLM_KNOBS)}, "
                             "vllm.ARG and env.NAME")


def env_knobs(overrides: dict[str, str]) -> dict[str, str | None]:
    """The `env.NAME` knobs: name -> value, None to unset."""
    return {k[len(ENV):]: (v or None) for k, v in overrides.items() if k.startswith(ENV)}


def split_knobs(text: str) -> list[str]:
    """"K=V,K=V" -> ["K=V", "K=V"], splitting only before a comma that starts another knob, so that a value may hold
    commas (JSON for an engine argument, a list in an environment variable)."""
    return [x for x in re.split(r",(?=\s*[A-Za-z_][\w.-]*=)", text) if x.strip()]
