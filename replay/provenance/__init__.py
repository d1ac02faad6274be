"""Provenance: what a capture was recorded with (header, environment, weights fingerprint) and what differs
between two such descriptions (a recording and its replay, or two recordings)."""

from replay.provenance.differences import (
    HeaderDifference,
    hardware_differences,
    header_differences,
    is_suspect,
    unknown_fields,
)
from replay.provenance.environment import (
    current_environment,
    pin_threading,
    relevant_env,
    set_mkl_dynamic,
    set_torch_threads,
)
from replay.provenance.hardware import current_hardware, hardware_summary
from replay.provenance.header import major_minor, make_header
from replay.provenance.weights import (
    Fingerprint,
    adapter_fingerprint,
    checkpoint_fingerprint,
)

__all__ = ["HeaderDifference", "hardware_differences", "header_differences", "unknown_fields", "current_hardware",
           "hardware_summary",
           "is_suspect", "current_environment", "pin_threading", "relevant_env", "set_mkl_dynamic",
           "set_torch_threads",
           "make_header", "major_minor", "Fingerprint", "adapter_fingerprint", "checkpoint_fingerprint"]
