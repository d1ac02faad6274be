"""What the current process looks like, for a capture header: the knobs that decide numerics."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time

from replay import __version__
from replay.capture.format import FORMAT_MAJOR, FORMAT_MINOR, EngineConfig, Environment, Header, ModelIdentity

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


def make_header(engine: str, *, engine_version: str = "", model: ModelIdentity | None = None,
                engine_config: EngineConfig | None = None, environment: Environment | None = None,
                extra: dict | None = None) -> Header:
    """A Header stamped with this tool's version and format, now."""
    return Header(
        format_version=(FORMAT_MAJOR, FORMAT_MINOR),
        tool_version=__version__,
        created=time.time(),
        engine=engine,
        engine_version=engine_version,
        model=model,
        engine_config=engine_config or EngineConfig(),
        environment=environment or current_environment(with_torch=False),
        extra=extra or {},
    )
