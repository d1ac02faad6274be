"""Load: a 100,000-step capture with 256 concurrent requests is recorded and read back in flat memory, and one
step is looked up through the index without reading the file (REPLAY_LOAD_STEPS shortens it for quick runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

STEPS = int(os.environ.get("REPLAY_LOAD_STEPS", "100000"))


@pytest.mark.slow
def test_long_capture_in_flat_memory():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-m", "bench.load", "--steps", str(STEPS), "--running", "256", "--json"],
                         capture_output=True, text=True, timeout=1200, cwd=root)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    print(res)
    assert res["steps_read"] == STEPS
    assert res["lookup_chunks"] == 1 and res["chunks"] > 100 * STEPS // 100_000
    rec, scan = res["record_rss_mb"], res["scan_rss_mb"]
    # recording keeps only the open chunk and the request-id table (which the seek index needs): ~100 B/request
    assert rec[-1] - rec[1] < 40, rec
    assert scan[-1] - scan[1] < 30, scan  # one chunk at a time; ~0.2 KB/step of allocator retention remains
