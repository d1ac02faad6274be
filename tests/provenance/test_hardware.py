"""The hardware provenance every header carries, and how two headers' hardware differs: first in the list, as
the leading suspect when a capture moves between machines."""

from __future__ import annotations

import platform

import pytest

from replay.capture.format.records import Environment, ModelIdentity
from replay.provenance import (
    current_hardware,
    hardware_differences,
    hardware_summary,
    header_differences,
    make_header,
)
from replay.provenance.hardware import KERNEL_ISA


def _header(hardware: dict[str, str], libraries: dict[str, str] | None = None):
    env = Environment(device="cpu", num_threads=2, hardware=hardware, libraries=libraries or {})
    return make_header("builtin", model=ModelIdentity("tiny", "LlamaForCausalLM", "ab" * 32, "float32"),
                       environment=env)


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="reads /proc/cpuinfo")
def test_this_machine_names_its_processor_and_the_features_kernels_dispatch_on():
    hw = current_hardware()
    assert hw["cpu_model"] and set(hw["cpu_isa"].split()) <= set(KERNEL_ISA) and "avx" in hw["cpu_isa"].split()
    assert hardware_summary(hw).startswith(hw["cpu_model"])
    assert make_header("builtin").environment.hardware == hw  # every header carries it


def test_hardware_differences_come_first_and_name_only_the_features_one_side_lacks():
    a = _header({"cpu_model": "Intel Xeon", "cpu_isa": "avx avx2 avx512f avx512bw"}, {"cpu_capability": "AVX512"})
    b = _header({"cpu_model": "AMD EPYC", "cpu_isa": "avx avx2"}, {"cpu_capability": "AVX2"})
    b.environment.num_threads = 1
    diffs = header_differences(a, b)
    assert [(d.label, d.a, d.b, d.affects) for d in diffs[:2]] == [
        ("processor", "Intel Xeon", "AMD EPYC", "hardware"), ("CPU features", "avx512f avx512bw", "none", "hardware")]
    assert [d.label for d in hardware_differences(diffs)] == ["processor", "CPU features", "cpu_capability"]
    assert "threads" in [d.label for d in diffs]


def test_hardware_one_side_could_not_read_is_unknown_not_different():
    a = _header({"cpu_model": "AMD EPYC", "cpu_isa": "avx avx2"})
    b = _header({"cpu_model": "AMD EPYC"})
    assert header_differences(a, b) == [] and header_differences(a, _header({})) == []


def test_a_gpu_summary_leads_with_the_device_and_its_libraries():
    hw = {"cpu_model": "AMD EPYC 9654", "cpu_isa": "avx2", "gpu": "NVIDIA H200", "gpu_capability": "9.0",
          "driver": "13.0", "cuda_runtime": "13.0", "cublas": "13.1.0", "cudnn": "91200", "nccl": "2.27.5"}
    assert hardware_summary(hw) == ("NVIDIA H200 sm 9.0 (driver 13.0, CUDA runtime 13.0, cuBLAS 13.1.0, cuDNN 91200, "
                                    "NCCL 2.27.5); host AMD EPYC 9654 (avx2)")
    other = dict(hw, gpu="NVIDIA A100-SXM4-80GB", gpu_capability="8.0")
    assert [d.as_note() for d in header_differences(_header(hw), _header(other))] == [
        "GPU: recorded NVIDIA H200, replay NVIDIA A100-SXM4-80GB", "compute capability: recorded 9.0, replay 8.0"]
