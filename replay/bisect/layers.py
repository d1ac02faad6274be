"""`bisect_layers`: run step S two ways with forward hooks on every named module and name the first module whose
output for request R differs (bitwise, max-abs, ULPs), and how the difference grows through the layers.

On the builtin runner (our modules) or on vLLM's own (`runner="vllm"`: vLLM's modules and kernels, in every worker,
shards of a tensor-parallel output put back together: `replay.integrations.vllm.taps`). Side B is R alone, the same
step under other knobs (any `--set` knob: `tensor_parallel_size=1`, `vllm.kv_cache_dtype=fp8`,
`env.ATEN_CPU_CAPABILITY=avx2`; environment knobs run that side in a fresh process), and/or a planted fault.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from replay.bisect.dump import write_dump
from replay.bisect.module_compare import LayersBisect, compare_modules, module_verdict
from replay.bisect.open_session import make_session
from replay.bisect.session import Run, response_request
from replay.errors import CannotTestError
from replay.integrations.vllm.engines import Engines
from replay.processes.in_environment import applied, in_environment
from replay.replayer import Plant, parse_overrides
from replay.replayer.knobs import Knobs, check_overrides, env_knobs, split_knobs


def side_runs(path: str, step: int, request: str, overrides: dict[str, str], runs: list[tuple[bool, Plant | None]],
              force: bool = False, log: Callable[[str], None] | None = None,
              fresh: bool = False, from_start: bool = False,
              engines: Engines | None = None) -> tuple[str, list[str], list[Run]]:
    """On one runner built with `overrides`: step `step` once per (alone, plant) in `runs`, every module hooked.
    Returns R as given (an OpenAI response's id: its prompt's request), the session's notes and the runs. With
    environment knobs, or `fresh`, this runs in a fresh process started with them
    (`replay.processes.in_environment`)."""
    env = env_knobs(overrides)
    if fresh or (env and not applied(env)):
        return in_environment(env, side_runs, path, step, request, overrides, runs, force, from_start=from_start)
    # R alone on vLLM's runner is alone in every step up to S: start before its neighbours there were scheduled
    alone = overrides.get("runner") == "vllm" and any(solo for solo, _ in runs)
    session = make_session(path, step, overrides, force=force, log=log, from_start=from_start, engines=engines,
                           watch=request if alone else None, request=request)
    try:
        rid = session.request_id(request)
        out = [session.run(rid, {rid} if alone else None, modules=True, plant=plant) for alone, plant in runs]
    finally:
        session.close()
    return response_request(request, session.internal), session.notes, out


def bisect_layers(path: str | os.PathLike, step: int, request: str, against: str = "solo", *,
                  plant: Plant | None = None, runner: str | None = None, overrides: Knobs | None = None,
                  dump: str | os.PathLike | None = None, dump_all: bool = False,
                  log: Callable[[str], None] | None = None, from_start: bool = False,
                  engines: Engines | None = None) -> LayersBisect:
    """Side A: step `step` as recorded (with `overrides`). Side B: R alone (`against="solo"`), the same step under
    other knobs (`"dtype=bfloat16,attention=reference"`, `"tensor_parallel_size=1"`), and/or with a planted fault
    (`plant`). `runner`: "builtin" or "vllm" (default: the `runner` knob, else builtin); `overrides`: a dict, "K=V,K=V"
    or a list. `dump`: a directory for
    both sides' outputs of the first differing modules, or of every module (`dump_all`: for `compare_dumps` across
    installs; `replay.bisect.dump`). Each side's replay to the step starts at the nearest keyframe unless
    `from_start`. `engines`: started vLLM engines to run on (`replay.integrations.vllm.engines`)."""
    log = log or (lambda msg: None)
    path = str(path)
    base = check_overrides(overrides, runner)
    runner = base.get("runner", "builtin")
    if against in ("solo", "", "same", "none"):
        log(f"replaying {path} to step {step}, twice ({'R alone' if against == 'solo' else 'as recorded'})")
        request, notes, (a, b) = side_runs(path, step, request, base, [(False, None), (against == "solo", plant)],
                                           log=log, from_start=from_start, engines=engines)
    else:
        knobs = parse_overrides(split_knobs(against) + ([f"runner={runner}"] if runner == "vllm" else []), "--against")
        fresh = bool(env_knobs(knobs))  # then side A runs in a fresh process too: the variables are the difference
        log(f"replaying {path} to step {step} (side A)")
        request, notes, (a,) = side_runs(path, step, request, base, [(False, None)], log=log, fresh=fresh,
                                         from_start=from_start, engines=None if fresh else engines)
        log(f"replaying {path} to step {step} with {against} (side B)")
        _, notes_b, (b,) = side_runs(path, step, request, {**base, **knobs}, [(False, plant)], force=True, log=log,
                                     from_start=from_start, engines=engines)
        notes = list(dict.fromkeys(notes + notes_b))
    diffs = compare_modules(a.modules, b.modules, a.gathered | b.gathered)
    if not diffs:
        raise CannotTestError(f"{path}: no module of side A's model has a counterpart in side B's output: nothing "
                              "was compared (another model on side B?)")
    first = next((d for d in diffs if not d.equal), None)
    what = against + (f" + planted {plant.size:g} in {plant.module}" if plant else "")
    on = " on vLLM's runner" if runner == "vllm" else ""
    verdict = module_verdict(f"request {request} at step {step}{on}", diffs, f"against {what}", f"against {what}")
    shapes = {n: t.shape for n, t in b.modules}
    apart = [n for n, t in a.modules if n in shapes and shapes[n] != t.shape]
    if apart:  # e.g. K/V heads replicated across more ranks than there are heads: their shards do not put back together
        notes.append(f"{len(apart)} modules not compared, their outputs' shapes differ between the sides: "
                     f"{', '.join(apart[:3])}{', ...' if len(apart) > 3 else ''}")
    if against == "solo" and runner == "vllm":
        notes.append(f"solo on vLLM's runner: request {request} alone in every step up to {step}, its earlier steps "
                     "too (vLLM's runner state cannot be restored to just before the step)")
    gathered = sum(d.gathered for d in diffs)
    if gathered:
        notes.append(f"{gathered} module outputs are sharded across tensor-parallel ranks: compared put back together")
    res = LayersBisect(path, step, request, what, verdict, first.module if first else None, diffs, runner, notes)
    if dump is not None:
        res.dump = write_dump(dump, res, a, b, every=dump_all)
    return res
