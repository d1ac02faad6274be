"""`bisect layers --dump DIR`: each side's output rows of the first differing modules, and of the modules just
before them (`--dump-all`: of every module), as safetensors files a kernel author loads with
`safetensors.torch.load_file`, with a small JSON index that says what each tensor is and what computed it.

`compare_dumps` (`replay bisect dumps A B`) takes two `--dump-all` dumps of the same step and request made in two
installs (two vLLM or torch versions, which cannot share a process) and names the first module whose output differs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from replay.bisect.module_compare import LayersBisect, compare_modules, module_verdict
from replay.bisect.session import Run
from replay.errors import UsageError

BEFORE = 2  # modules kept before the first differing one
DIFFERING = 3  # differing modules kept from the first one on


def dump_window(res: LayersBisect) -> list[str]:
    """The modules dumped: the `BEFORE` modules before the first differing one, and the first `DIFFERING` differing
    modules; none when no module differs."""
    names = [m.module for m in res.modules]
    if res.first_module is None:
        return []
    i = names.index(res.first_module)
    differing = [m.module for m in res.modules[i:] if not m.equal][:DIFFERING]
    return names[max(0, i - BEFORE):i] + differing


def _computed_by(runner: str) -> dict[str, str]:
    """What computed the tensors: the versions that decide their bits."""
    import torch

    import replay

    out = {"replay": replay.__version__, "torch": torch.__version__, "runner": runner}
    if runner == "vllm":
        import vllm

        out["vllm"] = vllm.__version__
    return out


def write_dump(directory: str | os.PathLike, res: LayersBisect, a: Run, b: Run, every: bool = False) -> str:
    """Write `a.safetensors` and `b.safetensors` (module name -> [rows, features] tensor, as each side computed it;
    `every`: every module, else `dump_window`'s) and `index.json` into `directory`; returns its path."""
    from safetensors.torch import save_file

    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--dump {directory}: {e.strerror or e}") from None
    keep = [m.module for m in res.modules] if every else dump_window(res)
    sides = {"a": dict(a.modules), "b": dict(b.modules)}
    for side, modules in sides.items():
        save_file({n: modules[n].contiguous() for n in keep}, str(out / f"{side}.safetensors"),
                  metadata={"capture": res.capture, "step": str(res.step), "request": res.request, "side": side})
    by_name = {m.module: m for m in res.modules}
    index = {
        "capture": res.capture, "step": res.step, "request": res.request, "runner": res.runner,
        "sides": {"a": "as recorded", "b": res.against},
        "rows": "the request's rows at the step: one per token it scheduled (the logits processor: one per logits "
                "row), flattened to [rows, features]",
        "first_module": res.first_module,
        "every_module": every,
        "computed_by": _computed_by(res.runner),
        "modules": [{"name": n, "shape": list(sides["a"][n].shape),
                     "dtype": str(sides["a"][n].dtype).removeprefix("torch."), "equal": by_name[n].equal,
                     "max_abs": by_name[n].max_abs, "max_ulps": by_name[n].max_ulps, "gathered": by_name[n].gathered}
                    for n in keep],
        "notes": res.notes,
    }
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return str(out)


def _load(directory: str | os.PathLike) -> tuple[dict, list[tuple[str, Any]]]:
    """A dump's index and side A's modules, in the index's (execution) order."""
    from safetensors.torch import load_file

    d = Path(directory)
    try:
        index = json.loads((d / "index.json").read_text())
        tensors = load_file(str(d / "a.safetensors"))
        modules = [(m["name"], tensors[m["name"]]) for m in index["modules"] if m["name"] in tensors]
        if "step" not in index or "request" not in index:
            raise KeyError("step, request")
    except Exception as e:  # noqa: BLE001 - a missing file, bad JSON, a safetensors error: not a dump, in one line
        raise UsageError(f"{directory}: not a dump of `replay bisect layers --dump` "
                         f"({type(e).__name__}: {e})") from None
    if not index.get("every_module"):
        raise UsageError(f"{directory}: a dump of the differing modules only; `bisect dumps` compares dumps made with "
                         "--dump-all (every module)")
    return index, modules


def compare_dumps(a: str | os.PathLike, b: str | os.PathLike) -> LayersBisect:
    """The first module whose output differs between two dumps' side A (`--dump-all` of one step and request, made in
    two installs), and how the difference grows; both must hold the same step and request."""
    ia, ma = _load(a)
    ib, mb = _load(b)
    if (ia["step"], ia["request"]) != (ib["step"], ib["request"]):
        raise UsageError(f"{a} holds request {ia['request']} at step {ia['step']}, {b} request {ib['request']} at "
                         f"step {ib['step']}: dumps compare one step of one request")
    diffs = compare_modules(ma, mb)
    if not diffs:
        raise UsageError(f"{a} and {b} share no module of one shape: nothing to compare (two models?)")
    apart = len({n for n, _ in ma} | {n for n, _ in mb}) - len(diffs)
    what = lambda i: ", ".join(f"{k} {v}" for k, v in i.get("computed_by", {}).items() if k != "replay")  # noqa: E731
    first = next((d for d in diffs if not d.equal), None)
    verdict = module_verdict(f"request {ia['request']} at step {ia['step']}", diffs, f"in {a} and {b}",
                             f"between {a} and {b}")
    notes = [f"{a}: {what(ia)}", f"{b}: {what(ib)}"]
    if apart:
        notes.append(f"{apart} modules not compared: in one dump only, or of another shape")
    return LayersBisect(str(a), ia["step"], ia["request"], str(b), verdict, first.module if first else None, diffs,
                        ia.get("runner", "builtin"), notes)
