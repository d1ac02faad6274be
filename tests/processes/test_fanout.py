"""`fan_out` over local processes: answers in any order, and a worker that dies is one `CannotTestError` (exit 125),
never concurrent.futures' BrokenProcessPool from deep inside."""

from __future__ import annotations

import os

import pytest

from replay.errors import CannotTestError
from replay.processes.fanout import FanOut, fan_out


def _square(x: int) -> int:
    return x * x


def _die(x: int) -> int:
    os._exit(9)  # what an out-of-memory kill, or a script without its __main__ guard, leaves the pool with


def test_every_answer_comes_back_with_its_index():
    assert sorted(fan_out(_square, [1, 2, 3], FanOut(jobs=2))) == [(0, 1), (1, 4), (2, 9)]


def test_a_worker_that_dies_is_one_clear_cannot_test():
    with pytest.raises(CannotTestError, match="a worker process of --jobs 2 died"):
        list(fan_out(_die, [1, 2], FanOut(jobs=2)))
