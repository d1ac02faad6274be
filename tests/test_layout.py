"""The package's shape, checked: imports go down the layers and never in a circle, modules stay small, public
functions are annotated.

Layers, bottom up (docs/design.md, "Layers"):

    errors -> contracts -> jsonable, capture, processes -> provenance, faults -> engine | integrations
        -> record | replayer | diff | inspect -> bisect, report, demo -> cli

A module may import its own package, anything in a lower layer, and nothing above. Within one layer only the
edges listed in SIDEWAYS are allowed (the replayer diffs what it replays; the demo writes its report; the trainer
bisects on the bisect's sessions). The vLLM integration never imports the builtin engine, nor the other way round.
Imports inside functions count: they are how a lower layer would reach up lazily.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "replay"

LAYERS: dict[str, int] = {
    "replay": 0,  # the package's __init__ (version only)
    "replay.errors": 0,
    "replay.contracts": 1,
    "replay.jsonable": 2,
    "replay.capture": 2,
    "replay.processes": 2,
    "replay.provenance": 3,
    "replay.faults": 3,  # test faults both runners plant in their models
    "replay.engine": 4,
    "replay.integrations": 4,
    "replay.record": 5,
    "replay.replayer": 5,
    "replay.diff": 5,
    "replay.inspect": 5,
    "replay.bisect": 6,
    "replay.report": 6,
    "replay.trainer": 6,
    "replay.demo": 6,
    "replay.cli": 7,
}
# the demo ends with its report; the trainer's --bisect runs the bisect's sessions and module hooks
SIDEWAYS = {("replay.replayer", "replay.diff"), ("replay.demo", "replay.report"), ("replay.trainer", "replay.bisect")}
SOFT_LINES = 400  # past this a module probably holds two concepts: a warning, to look at
MAX_LINES = 500
MAX_LOOSE = 5


def _room(module: str) -> str:
    """The layer entry a dotted module name belongs to (its longest prefix in LAYERS)."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        if name in LAYERS:
            return name
    raise KeyError(module)


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def _imports(module: str, path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append(name)
            out += [f"{name}.{a.name}" for a in node.names]  # `from replay import errors` names a module
    return [n for n in out if n == "replay" or n.startswith("replay.")]


def _violations() -> list[str]:
    known = {m for m, _ in _modules()}
    bad = []
    for module, path in _modules():
        here = _room(module)
        for target in _imports(module, path):
            while target not in known and "." in target:  # `from replay.x import name`: the module is replay.x
                target = target.rpartition(".")[0]
            there = _room(target)
            if there == here or there == "replay":
                continue
            if {here, there} == {"replay.engine", "replay.integrations"}:
                bad.append(f"{module} imports {target}: the builtin engine and the vLLM integration are independent")
            elif LAYERS[there] > LAYERS[here] or (LAYERS[there] == LAYERS[here] and (here, there) not in SIDEWAYS):
                bad.append(f"{module} (layer {LAYERS[here]}) imports {target} (layer {LAYERS[there]})")
    return bad


# The capture package's rooms, bottom up: the format, a step's stored form both ways, then writing and reading
# (reading may use the writer: `recover` writes a new capture), then the flight recorder (a ring of captures it
# writes and reads back into snapshots).
CAPTURE_ROOMS = {"format": 0, "codec": 1, "writing": 2, "reading": 2, "flight": 3}
CAPTURE_SIDEWAYS = {("reading", "writing")}


def _capture_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["replay", "capture"] else None


def test_the_capture_rooms_import_down_and_share_no_private_name():
    known = {m for m, _ in _modules()}
    bad = []
    for module, path in _modules():
        here = _capture_room(module)
        for target in _imports(module, path):
            if module.startswith("replay.capture") and any(
                    part.startswith("_") and not part.startswith("__") for part in target.split(".")):
                bad.append(f"{module} imports {target}: another module's private name")
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            there = _capture_room(target)
            if here is None or there is None or here == there:
                continue
            if here not in CAPTURE_ROOMS or there not in CAPTURE_ROOMS:
                bad.append(f"{module} or {target} is in no room of replay/capture")
            elif CAPTURE_ROOMS[there] > CAPTURE_ROOMS[here] or (
                    CAPTURE_ROOMS[there] == CAPTURE_ROOMS[here] and (here, there) not in CAPTURE_SIDEWAYS):
                bad.append(f"{module} ({here}) imports {target} ({there})")
    loose = sorted(p.name for p in (PACKAGE / "capture").glob("*.py") if p.name != "__init__.py")
    assert bad == [] and loose == []


def test_every_module_has_a_layer():
    for module, _ in _modules():
        _room(module)  # raises KeyError for a module outside every room


def test_imports_go_down_the_layers():
    assert _violations() == []


def test_no_module_is_over_500_lines():
    lines = {m: len(p.read_text().splitlines()) for m, p in _modules()}
    for m, n in lines.items():
        if n > SOFT_LINES:
            warnings.warn(f"{m}: {n} lines; past {SOFT_LINES} a module often holds two concepts", stacklevel=1)
    assert {m: n for m, n in lines.items() if n > MAX_LINES} == {}


def _import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (at the top or inside a function)."""
    known = {m for m, _ in _modules()}
    graph = {}
    for module, path in _modules():
        out = set()
        for target in _imports(module, path):
            while target not in known and "." in target:
                target = target.rpartition(".")[0]
            if target in known and target != module:
                out.add(target)
        graph[module] = out
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, targets = work[-1]
            w = next(targets, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def test_no_import_circle():
    assert _circles(_import_graph()) == []


def test_a_circle_is_found():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_at_most_five_modules_loose_under_the_package():
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= MAX_LOOSE, loose


def _public_functions(tree: ast.Module):
    """Module-level functions and methods of module-level classes whose names do not start with `_`."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and not item.name.startswith("_"):
                    yield f"{node.name}.{item.name}", item


@pytest.mark.parametrize("module,path", _modules(), ids=[m for m, _ in _modules()])
def test_public_functions_are_annotated_and_documented(module, path):
    if module.startswith("replay.cli."):  # typer commands: their parameters are typed, their docstrings are --help
        pass
    problems = []
    for name, fn in _public_functions(ast.parse(path.read_text())):
        args = fn.args
        params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
        if args.vararg:
            params.append(args.vararg)
        if args.kwarg:
            params.append(args.kwarg)
        missing = [a.arg for a in params if a.annotation is None and a.arg not in ("self", "cls")]
        if missing:
            problems.append(f"{name}: parameters without a type: {', '.join(missing)}")
        if fn.returns is None and fn.name != "__init__":
            problems.append(f"{name}: no return type")
        if ast.get_docstring(fn) is None:
            problems.append(f"{name}: no docstring")
    assert problems == []
