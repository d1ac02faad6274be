"""`check_corpus`: `replay check` over a corpus of captures (a directory, a glob, or a list file), fanned out over
local processes or Ray tasks (`fanout`), one row per capture, streamed into a results file so that an interrupted
run resumes where it stopped, and a summary that groups the captures by how their recording differs from this
runner's environment (the differences that explain the divergences).

Exit codes stay `git bisect run`-compatible: 1 when any capture diverges, 0 when none does (captures that cannot be
tested are rows with their reason, not a verdict on the candidate), 125 when none could be tested at all.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import msgspec

from replay.capture import CaptureReader
from replay.capture.format.records import PROLOGUE_MAGIC
from replay.diff import Tolerance
from replay.errors import EXIT_CANNOT_TEST, EXIT_DIVERGED, EXIT_OK, UsageError
from replay.integrations.vllm.engines import Engines, process_engines
from replay.processes.fanout import FanOut, fan_out
from replay.replayer.check import check_capture
from replay.replayer.options import ReplayOptions


class CheckSpec(msgspec.Struct, frozen=True):
    """What every capture of a corpus is checked with (the picklable part of ReplayOptions)."""

    mode: str = "forced"
    overrides: dict[str, str] = {}
    atol: float = 0.0
    rtol: float = 0.0
    auto_tolerance: bool = False
    force: bool = False

    @classmethod
    def of(cls, opts: ReplayOptions) -> CheckSpec:
        """The spec of `opts` (steps, plants and repeats are single-capture options)."""
        return cls(opts.mode, dict(opts.overrides), opts.tolerance.atol, opts.tolerance.rtol, opts.auto_tolerance,
                   opts.force)

    def options(self) -> ReplayOptions:
        """Back to ReplayOptions, in whichever process runs the check."""
        return ReplayOptions(mode=self.mode, overrides=dict(self.overrides), tolerance=Tolerance(self.atol, self.rtol),
                             auto_tolerance=self.auto_tolerance, force=self.force)


class CorpusRow(msgspec.Struct, omit_defaults=True):
    """One capture's answer."""

    capture: str
    verdict: str  # good | bad | cannot test
    code: int  # 0 | 1 | 125
    reason: str  # the one line `replay check` prints
    seconds: float
    key: str  # path, size and mtime: a results file row stands for this capture only while the file is unchanged
    first_divergence: str = ""  # "step 3, request req-0 (logprobs)"
    suspect: str = ""  # the leading difference between the recording and this runner, on a divergence
    differences: list[str] = []  # every numerics-relevant difference between the recording and this runner
    engine_starts: int = 0  # vLLM engines this check started (0: it reused one, or ran on the builtin runner)
    data_lost: str = ""  # the capture's first loss (damage, an unfinished tail): only its readable prefix was checked


class CorpusGroup(msgspec.Struct):
    """Captures whose recordings differ from this runner in the same way."""

    differences: list[str]  # empty: recorded like this runner (or, in the untested group, not known)
    captures: int
    diverged: int
    cannot_test: int
    tested: bool = True  # False: the captures that could not be tested, never compared with this runner

    @property
    def label(self) -> str:
        """How the group's recordings differ from this runner, as the summary and the page say it."""
        if not self.tested:
            return "not compared: could not be tested (the rows say why)"
        return "; ".join(self.differences) if self.differences else "recorded like this runner (no difference)"


class CorpusResult(msgspec.Struct):
    """`replay check CORPUS`: every row, the groups, and the exit code."""

    corpus: str
    how: str  # serial | N local processes | Ray (...)
    rows: list[CorpusRow]
    groups: list[CorpusGroup]
    good: int
    bad: int
    cannot_test: int
    resumed: int  # rows taken from the results file instead of re-run
    seconds: float
    code: int
    # vLLM engines this run started: one per layout in this process or in each `--jobs` worker, one per capture on Ray
    engine_starts: int = 0
    verdict: str = ""  # the summary line the terminal ends with (`corpus_verdict`)


def corpus_paths(spec: str | os.PathLike) -> list[Path]:
    """The captures a corpus names, in name order: a directory's captures (recursively), a glob's matches, a list
    file's lines (one path per line, relative to the list file; blank lines and `#` comments skipped), or one
    capture file."""
    text = str(spec)
    p = Path(text)
    if p.is_dir():
        found = sorted({*p.rglob("*.capture"), *p.rglob("*.capture.partial")})
        found = [f for f in found if not (f.name.endswith(".partial") and f.with_name(f.name[:-8]) in found)]
        if not found:
            raise UsageError(f"{p}: no captures in this directory")
        return found
    if set("*?[") & set(text):
        found = sorted(Path(x) for x in glob.glob(text, recursive=True))
        if not found:
            raise UsageError(f"{text}: no captures match")
        return found
    if not p.is_file():
        raise UsageError(f"{p}: no such capture, directory or list file")
    if _is_capture(p):
        return [p]
    try:
        lines = p.read_text().splitlines()
    except UnicodeDecodeError:  # binary: a capture whose first bytes are damaged; the reader says how
        return [p]
    except OSError as e:
        raise UsageError(f"{p}: cannot read ({e.strerror or e})") from None
    out = [p.parent / line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not out:
        raise UsageError(f"{p}: the list names no captures")
    return out


def _is_capture(p: Path) -> bool:
    with open(p, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and int.from_bytes(head, "little") == PROLOGUE_MAGIC


def _key(p: Path) -> str:
    try:
        st = p.stat()
    except OSError:
        return f"{p}|missing"
    return f"{p}|{st.st_size}|{st.st_mtime_ns}"


def check_one(task: tuple[str, CheckSpec], engines: Engines | None = None) -> CorpusRow:
    """Check one capture (in whichever process or Ray worker runs it; `engines`: vLLM engines started for earlier
    captures of this process, to reuse, else one started for this capture alone); never raises for the capture."""
    path, spec = task
    t = time.perf_counter()
    pool = engines if engines is not None or not _on_vllm(spec) else Engines()
    before = pool.starts if pool is not None else 0
    try:
        res = check_capture(path, dataclasses.replace(spec.options(), engines=pool))
    finally:
        if engines is None and pool is not None:
            pool.close()
    rep = res.report
    first = suspect = ""
    differences: list[str] = []
    if rep is not None:
        differences = list(rep.environment_differences)
        if rep.first_divergence is not None:
            d = rep.first_divergence
            first = f"step {d.step}, request {d.request_id} ({d.kind})"
        suspect = rep.suspect
    return CorpusRow(path, res.verdict, res.code, res.reason, round(time.perf_counter() - t, 3), _key(Path(path)),
                     first, suspect, differences, pool.starts - before if pool is not None else 0,
                     rep.data_lost[0] if rep is not None and rep.data_lost else res.damaged)


def check_in_worker(task: tuple[str, CheckSpec]) -> CorpusRow:
    """`check_one` in a local worker process (`--jobs N`): the worker's own vLLM engine serves every capture of its
    layout it checks (one engine at a time: N workers hold N), and is shut down as the worker exits. (Ray tasks
    start their own: a Ray worker outlives its task, and an idle engine there would hold memory the scheduler has
    already handed to the next task.)"""
    return check_one(task, process_engines(keep=1) if _on_vllm(task[1]) else None)


def _on_vllm(spec: CheckSpec) -> bool:
    return spec.overrides.get("runner") == "vllm"


def _resources(spec: CheckSpec) -> Callable[[tuple[str, CheckSpec]], dict[str, float]]:
    """What one Ray task needs: a GPU per worker for a CUDA replay, else one CPU per recorded torch thread."""

    def need(task: tuple[str, CheckSpec]) -> dict[str, float]:
        try:
            with CaptureReader(task[0]) as r:
                h = r.header
        except Exception:  # noqa: BLE001 - an unreadable capture is a "cannot test" row; one CPU finds that out
            return {"num_cpus": 1}
        device = spec.overrides.get("device") or h.environment.device or "cpu"
        if device.startswith("cuda"):
            layout = h.engine_config.layout if h.engine_config else {}
            workers = int(layout.get("tensor_parallel_size", 1)) * int(layout.get("pipeline_parallel_size", 1))
            return {"num_cpus": 1, "num_gpus": workers if spec.overrides.get("runner") == "vllm" else 1}
        threads = int(spec.overrides.get("threads") or h.environment.num_threads or 1)
        return {"num_cpus": max(1, threads)}

    return need


def _read_results(path: Path) -> dict[str, CorpusRow]:
    """Rows of an earlier run, by key; a torn last line (the run was killed mid-write) is ignored."""
    out: dict[str, CorpusRow] = {}
    if not path.exists():
        return out
    dec = msgspec.json.Decoder(CorpusRow)
    for line in path.read_bytes().splitlines():
        try:
            row = dec.decode(line)
        except msgspec.DecodeError:
            continue
        out[row.key] = row
    return out


def _ends_with_newline(path: Path) -> bool:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"


def corpus_groups(rows: list[CorpusRow]) -> list[CorpusGroup]:
    """The rows grouped by the differences their recordings have from this runner, the diverging groups first."""
    by: dict[tuple[str, ...], list[CorpusRow]] = defaultdict(list)
    untested = [r for r in rows if r.code == EXIT_CANNOT_TEST]  # no replay: how they differ from here is unknown
    for r in rows:
        if r.code != EXIT_CANNOT_TEST:
            by[tuple(sorted(r.differences))].append(r)
    groups = [CorpusGroup(list(k), len(v), sum(r.code == EXIT_DIVERGED for r in v), 0) for k, v in by.items()]
    groups.sort(key=lambda g: (-g.diverged, len(g.differences), g.differences))
    if untested:
        groups.append(CorpusGroup([], len(untested), 0, len(untested), tested=False))
    return groups


def check_corpus(corpus: str | os.PathLike, opts: ReplayOptions | None = None, *, how: FanOut = FanOut(),
                 results: str | os.PathLike | None = None,
                 on_row: Callable[[CorpusRow], None] | None = None) -> CorpusResult:
    """Check every capture of `corpus` (see `corpus_paths`) with `opts`, fanned out `how`. `results`: a JSONL file
    each row is appended to as it finishes; rows already there for an unchanged capture are reused (resume).
    `on_row`: called for each row as it arrives (progress). On vLLM's runner the captures checked in this process
    share one engine per layout: from `opts.engines` where given (left open), else from a pool of its own."""
    t = time.perf_counter()
    paths = corpus_paths(corpus)
    spec = CheckSpec.of(opts or ReplayOptions())
    done = _read_results(Path(results)) if results is not None else {}
    rows: dict[str, CorpusRow] = {}
    todo = []
    for p in paths:
        row = done.get(_key(p))
        if row is not None:
            rows[str(p)] = row
        else:
            todo.append((str(p), spec))
    resumed = len(rows)
    try:
        out = open(results, "ab") if results is not None else None
    except OSError as e:
        raise UsageError(f"--results {results}: cannot write it ({e.strerror})") from None
    if out is not None and out.tell() and not _ends_with_newline(Path(results)):
        out.write(b"\n")  # a run killed mid-row left a torn line: the next row starts on its own
    in_here = not how.ray and (how.jobs <= 1 or len(todo) <= 1)  # then one vLLM engine serves each layout
    given = opts.engines if opts is not None and in_here else None  # a script's pool, left open for it
    engines = given or (Engines() if in_here and _on_vllm(spec) else None)
    if engines is not None:
        task = functools.partial(check_one, engines=engines)
    else:
        task = check_one if how.ray else check_in_worker
    started = 0
    try:
        for _, row in fan_out(task, todo, how, _resources(spec)):
            started += row.engine_starts
            rows[row.capture] = row
            if out is not None:
                out.write(msgspec.json.encode(row) + b"\n")
                out.flush()
            if on_row is not None:
                on_row(row)
    finally:
        if out is not None:
            out.close()
        if engines is not None and given is None:
            engines.close()
    ordered = [rows[str(p)] for p in paths]
    good = sum(r.code == EXIT_OK for r in ordered)
    bad = sum(r.code == EXIT_DIVERGED for r in ordered)
    cannot = len(ordered) - good - bad
    code = EXIT_DIVERGED if bad else EXIT_OK if good else EXIT_CANNOT_TEST
    res = CorpusResult(str(corpus), how.describe(), ordered, corpus_groups(ordered), good, bad, cannot, resumed,
                       round(time.perf_counter() - t, 3), code, started)
    res.verdict = corpus_verdict(res)
    return res


def corpus_verdict(res: CorpusResult) -> str:
    """'10 captures: 9 good, 1 bad, 0 cannot test (serial, 41.2 s, 1 vLLM engine(s) started)'."""
    resumed = f", {res.resumed} resumed from the results file" if res.resumed else ""
    started = f", {res.engine_starts} vLLM engine(s) started" if res.engine_starts else ""
    lost = sum(bool(r.data_lost) for r in res.rows)
    started += f"; {lost} of them lost data" if lost else ""
    return (f"{len(res.rows)} captures: {res.good} good, {res.bad} bad, {res.cannot_test} cannot test "
            f"({res.how}, {res.seconds:.1f} s{resumed}{started})")
