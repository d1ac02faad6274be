"""`bisect layers --dump DIR`: each side's output rows of the first differing modules, and of the modules just
before them, as safetensors files a kernel author loads with `safetensors.torch.load_file`, with a small JSON index
that says what each tensor is."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from replay.errors import UsageError

if TYPE_CHECKING:
    from replay.bisect.layers import LayersBisect
    from replay.bisect.session import Run

BEFORE = 2  # modules kept before the first differing one
DIFFERING = 3  # differing modules kept from the first one on


def dump_window(res: "LayersBisect") -> list[str]:
    """The modules dumped: the `BEFORE` modules before the first differing one, and the first `DIFFERING` differing
    modules; none when no module differs."""
    names = [m.module for m in res.modules]
    if res.first_module is None:
        return []
    i = names.index(res.first_module)
    differing = [m.module for m in res.modules[i:] if not m.equal][:DIFFERING]
    return names[max(0, i - BEFORE):i] + differing


def write_dump(directory: str | os.PathLike, res: "LayersBisect", a: "Run", b: "Run") -> str:
    """Write `a.safetensors` and `b.safetensors` (module name -> [rows, features] tensor, as each side computed it)
    and `index.json` into `directory`; returns its path."""
    from safetensors.torch import save_file

    out = Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--dump {directory}: {e.strerror or e}") from None
    keep = dump_window(res)
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
        "modules": [{"name": n, "shape": list(sides["a"][n].shape),
                     "dtype": str(sides["a"][n].dtype).removeprefix("torch."), "equal": by_name[n].equal,
                     "max_abs": by_name[n].max_abs, "max_ulps": by_name[n].max_ulps, "gathered": by_name[n].gathered}
                    for n in keep],
        "notes": res.notes,
    }
    (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
    return str(out)
