"""The hardware a run computed on, as far as it decides numerics: the processor and the instruction-set features its
kernels dispatch on (ATen, oneDNN and MKL pick their kernels from these at run time, so the same torch build gives
other bits on another processor), and on CUDA the device, its compute capability and the driver and library
versions. Recorded in every header (`Environment.hardware`); a replay compares it first."""

from __future__ import annotations

import ctypes
import platform
import re

# The CPU features that choose kernels (x86: the vector widths and the bf16/fp16/int8 dot-product extensions;
# ARM: NEON, SVE and the bf16/i8mm matmul extensions). Other /proc/cpuinfo flags (security mitigations,
# virtualisation) say nothing about what a kernel computes.
KERNEL_ISA = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512dq", "avx512cd", "avx512bw",
              "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512vbmi", "amx_tile", "amx_bf16",
              "amx_int8", "amx_fp16", "asimd", "asimddp", "sve", "sve2", "bf16", "i8mm")

# How reports name each hardware key.
LABELS = {"cpu_model": "processor", "cpu_isa": "CPU features", "gpu": "GPU", "gpu_capability": "compute capability",
          "driver": "driver", "cuda_runtime": "CUDA runtime", "cublas": "cuBLAS", "cudnn": "cuDNN", "nccl": "NCCL"}


def current_hardware(device: str = "cpu") -> dict[str, str]:
    """This machine: `cpu_model`, `cpu_isa` (KERNEL_ISA features present, space-separated) and, for a CUDA
    `device`, `gpu`, `gpu_capability`, `driver`, `cuda_runtime`, `cublas`, `cudnn`, `nccl`. Keys it cannot
    read are left out (unknown is not a difference)."""
    out = _cpu()
    if device.startswith("cuda"):
        out.update(_cuda(device))
    return out


def _cpu() -> dict[str, str]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "Model Name", "cpu model") and not model:
                    model = " ".join(value.split())
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:  # not Linux: the platform module's name, no feature list
        pass
    out = {"cpu_model": model or platform.processor() or platform.machine()}
    if flags:
        out["cpu_isa"] = " ".join(f for f in KERNEL_ISA if f in flags)
    return out


def _cuda(device: str) -> dict[str, str]:
    """The CUDA side, read through torch and the driver's C API (no NVML needed)."""
    import torch

    out: dict[str, str] = {}
    if not torch.cuda.is_available():
        return out
    dev = torch.device(device)
    out["gpu"] = torch.cuda.get_device_name(dev)
    out["gpu_capability"] = "{}.{}".format(*torch.cuda.get_device_capability(dev))
    out["cuda_runtime"] = str(torch.version.cuda or "")
    driver = _driver_version()
    if driver:
        out["driver"] = driver
    cublas = _cublas_version()
    if cublas:
        out["cublas"] = cublas
    if torch.backends.cudnn.is_available():
        out["cudnn"] = str(torch.backends.cudnn.version())
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a build without NCCL
        pass
    return {k: v for k, v in out.items() if v}


def _driver_version() -> str:
    """The CUDA driver API version the installed driver supports (cuDriverGetVersion: 12040 is 12.4)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"{v.value // 1000}.{v.value % 1000 // 10}"
    except (OSError, AttributeError):
        pass
    return ""


def _cublas_version() -> str:
    """The cuBLAS this process loaded (torch links it; cublasGetProperty needs no handle)."""
    path = _loaded_library("libcublas.so")
    if path is None:
        return ""
    try:
        lib = ctypes.CDLL(path)
        parts = []
        for prop in range(3):  # MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL
            v = ctypes.c_int()
            if lib.cublasGetProperty(prop, ctypes.byref(v)) != 0:
                return ""
            parts.append(str(v.value))
        return ".".join(parts)
    except (OSError, AttributeError):
        return ""


def _loaded_library(stem: str) -> str | None:
    """The path of a shared library this process has mapped whose file name starts with `stem`."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                path = line.split()[-1] if "/" in line else ""
                if re.search(rf"/{re.escape(stem)}[.\d]*$", path):
                    return path
    except OSError:
        pass
    return None


def hardware_summary(hardware: dict[str, str]) -> str:
    """One line for `replay info`: 'AMD EPYC (avx avx2 fma f16c)' or the GPU first where there is one."""
    cpu = hardware.get("cpu_model", "")
    isa = hardware.get("cpu_isa", "")
    text = f"{cpu} ({isa})" if cpu and isa else cpu
    if hardware.get("gpu"):
        gpu = f"{hardware['gpu']} sm {hardware.get('gpu_capability', '?')}"
        libs = ", ".join(f"{LABELS[k]} {hardware[k]}" for k in ("driver", "cuda_runtime", "cublas", "cudnn", "nccl")
                         if hardware.get(k))
        text = f"{gpu} ({libs}); host {text}" if libs else f"{gpu}; host {text}"
    return text
