"""What the current process looks like: the environment knobs that decide numerics, for a capture header."""

from __future__ import annotations

import os
import platform
import socket
import sys

from replay.capture.format import Environment

# Environment variables that change kernels, threading or determinism; recorded so replay can name a difference.
RELEVANT_ENV_PREFIXES = ("VLLM_", "CUBLAS_", "CUDA_", "NCCL_", "OMP_", "MKL_", "OPENBLAS_", "TORCH_", "PYTORCH_",
                         "KMP_", "REPLAY_")


def relevant_env() -> dict[str, str]:
    """The environment variables, among RELEVANT_ENV_PREFIXES, that are set."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(RELEVANT_ENV_PREFIXES)}


def current_environment(*, with_torch: bool = True, device: str = "cpu") -> Environment:
    """Describe this process. `with_torch=False` avoids importing torch (engines that do not use it)."""
    env = Environment(
        device=device,
        python_version=platform.python_version(),
        platform=platform.platform(),
        hostname=socket.gethostname(),
        env=relevant_env(),
    )
    if with_torch or "torch" in sys.modules:
        import torch

        env.torch_version = str(torch.__version__)
        env.cuda_version = str(torch.version.cuda or "")
        env.num_threads = torch.get_num_threads()
        env.deterministic_algorithms = torch.are_deterministic_algorithms_enabled()
        env.matmul_precision = torch.get_float32_matmul_precision()
        if device.startswith("cuda") and torch.cuda.is_available():
            env.device = torch.cuda.get_device_name(torch.device(device))
    return env


def set_torch_threads(n: int) -> int:
    """Give torch `n` intra-op threads, and return the count torch then reports. Works in a process where vLLM's CPU
    worker has replaced `torch.set_num_threads` with a no-op (it does once it has bound its OpenMP threads), so a
    builtin run after a vLLM engine in the same process still gets the thread count it asks for."""
    import torch

    torch._C.set_num_threads(n)
    return torch.get_num_threads()
