"""What a header says about the process: the environment variables and library settings that steer kernels and
threading are recorded, and a replay run differently names them before its verdict."""

from __future__ import annotations

import os
import subprocess
import sys

from replay.provenance import current_environment, pin_threading, relevant_env


def test_library_settings_are_recorded():
    pin_threading()
    libs = current_environment().libraries
    assert libs["cpu_capability"] in ("DEFAULT", "AVX2", "AVX512", "NO AVX", "ZVECTOR", "VSX", "SVE256", "SVE")
    assert libs["mkl_dynamic"] in ("off", "n/a") and libs["omp_dynamic"] == "off"
    assert int(libs["cpus_allowed"]) >= 1 and "onednn" in libs


def test_numerics_environment_variables_are_recorded(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so")  # too late to act: not what this process runs with
    monkeypatch.setenv("HOME_OF_NOTHING", "x")
    env = relevant_env()
    assert {"ATEN_CPU_CAPABILITY", "ONEDNN_DEFAULT_FPMATH_MODE"} <= set(env)
    assert "HOME_OF_NOTHING" not in env and env.get("LD_PRELOAD") != "/usr/lib/libtcmalloc.so"


def test_a_preload_the_process_started_with_is_recorded(tmp_path):
    code = "from replay.provenance import relevant_env; print(relevant_env().get('LD_PRELOAD'))"
    lib = subprocess.run(["python3", "-c", "import ctypes.util; print(ctypes.util.find_library('m') or '')"],
                         capture_output=True, text=True).stdout.strip()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, LD_PRELOAD=lib))
    assert out.stdout.strip() == lib


def test_a_replay_run_differently_names_the_difference_before_its_verdict(tmp_path):
    """A recording whose ATen kernels were forced to AVX2 (the CPU capability is picked when torch loads, so the
    recording runs in its own process) replayed in this one: the note comes first, whatever the verdict."""
    out = tmp_path / "avx2.capture"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    rec = subprocess.run([sys.executable, "-m", "replay.cli", "record", "--num-requests", "3", "--output-len", "2:4",
                          "--threads", "1", "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert rec.returncode == 0, rec.stderr
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    run = subprocess.run([sys.executable, "-m", "replay.cli", "run", str(out), "--diff"], env=env,
                         capture_output=True, text=True, timeout=300)
    lines = run.stdout.splitlines()
    notes = lines[:lines.index(next(line for line in lines if line.startswith("replayed ")))]
    assert "note: ATEN_CPU_CAPABILITY: recorded avx2, replay -" in notes, run.stdout
    capability = current_environment().libraries["cpu_capability"]
    if capability != "AVX2":  # this processor has more than AVX2: the kernels themselves were different ones
        assert f"note: cpu_capability: recorded AVX2, replay {capability}" in notes
