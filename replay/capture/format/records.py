"""The capture file format: records, limits, version, and where the bytes go (docs/capture-format.md).

The parts of a capture file, every piece a zstd frame so that `zstd -dc FILE` prints the records:

    [skippable frame  magic 0x184D2A5E]  b"RPLYCAP\\0" + u16 major + u16 minor (little-endian)
    [zstd frame: chunk 0]  a msgpack array of records: the Header first
    [zstd frame: chunk 1]  ... each chunk independent, with its content checksum and content size
    ...
    [skippable frame  magic 0x184D2A5F]  zstd(msgpack(Index)) + u32 crc32(index bytes) + u64 frame offset + b"RPLYIDX2"
                                         (1.0-1.2: msgpack(Index) uncompressed, b"RPLYIDX1")

A crash leaves the file without the index (and named `NAME.partial`): the reader then scans frames linearly, and
`recover` rewrites it. Each chunk decompresses to one msgpack array whose items are records, so `zstd -dc` gives a
plain concatenation of msgpack arrays of records.

Schema evolution (msgspec's rules): new fields go last with defaults, nothing is reordered or retyped. A reader
skips record tags it does not know (a newer minor version); a newer major version is refused.
"""

from __future__ import annotations

import os
import traceback
from typing import Any, Generic

import msgspec

from replay.capture.format.keyframe import Keyframe
from replay.contracts import (
    RID,
    Array,
    EngineCoreRequest,
    GrammarOutput,
    ModelRunnerOutput,
    SchedulerOutput,
)

FORMAT_MAJOR = 1
# 1.1: Crash records (a 1.0 reader skips them, and sees the crashed step as one with no output)
# 1.2: draft-token counts in the seek index (a 1.1 reader finds the index of a capture with drafts unreadable, says
#      so, and reads the capture by linear scan; captures without drafts are unchanged)
# 1.3: logprob columns: a chunk's logprob matrices in one `LogprobColumns` record first in the chunk, the steps'
#      arrays marked `chunk-column:G:ROW` (a 1.2 reader skips the record and finds those steps' logprobs unreadable);
#      `StepImage` records: another engine's step as its own objects' msgpack images; `PackedStep`: a Step with its
#      computed-token counts stored against its output-token counts (a 1.2 reader skips both)
# 1.4: `AlignedStep`: a PackedStep whose per-request maps are stored as lists in the step's batch order (a 1.3
#      reader skips these steps as unknown records)
# 1.5: the writer keeps only the live requests' ids: a chunk's first step is preceded by a `LiveIds` record that
#      re-declares the handles live when it began, the seek index's `ids` is empty and `num_requests` counts them
#      (a 1.4 reader skips LiveIds, and resolves only the handles its chunks declare as new)
# 1.6: `Keyframe` records (`replay.capture.format.keyframe`): the runner state before a chunk's first step, first in
#      that chunk, so a replay can start there; `ChunkInfo.keyframe` names that step (a 1.5 reader skips them)
FORMAT_MINOR = 6

PROLOGUE_MAGIC = 0x184D2A5E  # zstd skippable-frame magic (0x184D2A50..5F), nibble E: "replay prologue"
INDEX_MAGIC = 0x184D2A5F  # nibble F: "replay seek index"
PROLOGUE_ID = b"RPLYCAP\0"
INDEX_TRAILER_ID = b"RPLYIDX1"  # the index body is msgpack(Index) (formats 1.0-1.2)
INDEX_TRAILER_ZSTD = b"RPLYIDX2"  # 1.3: the body is one zstd frame of msgpack(Index) (request ids are most of it)

# Limits that bound memory on hostile input: a frame that claims (or expands to) more is refused before any
# allocation of that size. Both are far above anything our writer produces (chunks are ~1 MiB).
MAX_FRAME_BYTES = 256 << 20
MAX_RECORD_BYTES = 256 << 20
MAX_INDEX_BYTES = 256 << 20

DEFAULT_CHUNK_BYTES = 1 << 20  # close a chunk past this many uncompressed bytes
DEFAULT_FLUSH_INTERVAL = 1.0  # ... or once its oldest record is this many seconds old
DEFAULT_LEVEL = 3  # zstd level: ~500 MB/s on one core here, within 10 % of level 19 on our frames


class ModelIdentity(msgspec.Struct, omit_defaults=True):
    """Which model produced the capture; replay refuses a different one unless forced."""

    name: str  # "tiny", a checkpoint directory, or a hub-style name
    architecture: str = ""  # e.g. "LlamaForCausalLM"
    fingerprint: str = ""  # hash of the weights (sha256 of their bytes, or of config + seed for generated models)
    dtype: str = ""  # "float32" | "bfloat16" | "float16"
    path: str = ""  # where it was loaded from, if anywhere (absolute, where it was a local directory)
    config: dict[str, Any] = {}  # the model config (config.json fields)

    def location(self) -> str:
        """Where to load the model from here: its name where that resolves from this directory (a replay started
        where the recording was), else the absolute path recorded (a capture replayed from elsewhere)."""
        if self.name and os.path.exists(self.name):
            return self.name
        return self.path or self.name


class EngineConfig(msgspec.Struct, omit_defaults=True):
    """The engine settings that change what a step computes or how steps are formed."""

    block_size: int = 16
    num_gpu_blocks: int = 0  # KV blocks available; replay needs at least the largest block id + 1
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    max_model_len: int = 0
    enable_prefix_caching: bool = False
    enable_chunked_prefill: bool = False
    attention_impl: str = ""  # attention backend / implementation
    seed: int | None = None  # engine-level seed (vLLM ModelConfig.seed)
    logprobs_mode: str = "raw_logprobs"
    async_scheduling: bool = False
    runner_class: str = ""
    batch_invariant: bool = False
    extra: dict[str, Any] = {}  # engine-specific settings, by the engine's own names
    # how the engine lays the model out and compiles it, by vLLM's names (tensor_parallel_size,
    # pipeline_parallel_size, data_parallel_size, distributed_executor_backend, compilation_mode, cudagraph_mode,
    # enforce_eager, kv_cache_dtype, quantization, speculative_config), values as text
    layout: dict[str, str] = {}


class Environment(msgspec.Struct, omit_defaults=True):
    """The environment knobs that decide numerics, so replay can say exactly what differs."""

    device: str = ""  # "cpu", or the GPU name
    torch_version: str = ""
    cuda_version: str = ""
    num_threads: int = 0  # torch intra-op threads
    deterministic_algorithms: bool = False
    matmul_precision: str = ""  # torch.get_float32_matmul_precision()
    python_version: str = ""
    platform: str = ""
    hostname: str = ""
    env: dict[str, str] = {}  # relevant environment variables (VLLM_*, CUBLAS_*, OMP_*, ATEN_*, LD_PRELOAD, ...)
    # library settings that steer kernels and threading: cpu_capability (ATen's kernel ISA), mkl, onednn and
    # openmp versions, mkl_dynamic / omp_dynamic (thread-count adjustment), interop_threads, cpus_allowed
    libraries: dict[str, str] = {}
    # the hardware that decides numerics (replay.provenance.hardware): cpu_model, cpu_isa (the kernel-dispatch
    # features present), and on CUDA gpu, gpu_capability, driver, cuda_runtime, cublas, cudnn, nccl
    hardware: dict[str, str] = {}


class Header(msgspec.Struct, tag="header", array_like=True, omit_defaults=True):
    """Provenance, always the first record of chunk 0."""

    format_version: tuple[int, int]  # (major, minor) this file was written with
    tool_version: str  # replay's version
    created: float  # time.time() at open
    engine: str  # "builtin" | "vllm" | "synthetic" | another engine's name
    engine_version: str = ""
    model: ModelIdentity | None = None
    engine_config: EngineConfig = msgspec.field(default_factory=EngineConfig)
    environment: Environment = msgspec.field(default_factory=Environment)
    extra: dict[str, Any] = {}  # anything else the source wants replay to know, by name


class RequestAdded(msgspec.Struct, tag="request_added", array_like=True, omit_defaults=True):
    """A request arrived; it can first be scheduled in step `step`."""

    step: int  # index of the next step to run when it arrived
    request: EngineCoreRequest


class RequestAborted(msgspec.Struct, tag="request_aborted", array_like=True, omit_defaults=True):
    """A client aborted a request before step `step`."""

    step: int
    request_id: str  # internal id, as in EngineCoreRequest.request_id


class Ids(msgspec.Struct, tag="ids", array_like=True):
    """Declares request-id handles: `ids[i]` is handle `first + i`. Written just before the record that first
    uses them, in the same chunk, so every chunk read in order resolves its handles."""

    first: int
    ids: list[str]


class LiveIds(msgspec.Struct, tag="live_ids", array_like=True):
    """Format 1.5: the request-id handles live (arrived or scheduled, not yet finished) when a chunk's first step was
    written, `ids[i]` being handle `handles[i]`. It precedes that step, so one chunk resolves every handle its steps
    use (with the `Ids` of those that come new in it), and neither the writer nor a reader keeps the ids of requests
    that finished: their memory follows the live requests, not every request since the capture began."""

    handles: list[int]
    ids: list[str]


class StepTiming(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where the step's wall time went (ns), as the engine measured it."""

    start_ns: int = 0  # time.monotonic_ns() when schedule() began
    schedule_ns: int = 0
    execute_ns: int = 0  # model forward + sampling
    update_ns: int = 0  # update_from_output


class Step(msgspec.Struct, Generic[RID], tag="step", array_like=True, omit_defaults=True):
    """One engine step: what went into the runner, what came out, and what reproduces its sampling."""

    index: int  # engine step counter; consecutive from 0 unless the tap attached mid-run
    scheduler_output: SchedulerOutput[RID]
    model_runner_output: ModelRunnerOutput[RID] | None  # None: the step ran nothing (no scheduled tokens)
    # req_id -> seed the engine drew for an *unseeded* sampled request (Model Runner V2 style); lets replay
    # reproduce random sampling without a global generator.
    drawn_seeds: dict[RID, int] = {}
    rng_state: Array | None = None  # global generator state before the step, where the engine uses one
    timing: StepTiming | None = None
    grammar_output: GrammarOutput[RID] | None = None  # structured-output bitmask given to sample_tokens


class PackedStep(Step[int], tag="packed_step"):
    """Format 1.3: a stored `Step` whose `scheduled_cached_reqs.num_computed_tokens[i]` holds `num_computed_tokens[i]
    - num_output_tokens[i]`. For a decoding request that is its prompt length, the same every step, so the column
    repeats from step to step and compresses to almost nothing, where the raw counts, all growing, cost 1.7 B per
    generated token (capture_bench without logprobs: 7.0 -> 5.4). A new tag, so that a 1.2 reader skips these steps
    instead of reading the differences as counts. Written only when both lists have one entry per request."""


# `AlignedStep.elided` bits: what the stored step leaves out because the batch order gives it back.
COMPUTED_MINUS_OUTPUT = 1  # num_computed_tokens[i] holds num_computed_tokens[i] - num_output_tokens[i] (PackedStep's)
OUTPUT_IDS_IN_BATCH_ORDER = 2  # model_runner_output.req_ids (stored empty) is the batch order
OUTPUT_INDEX_IN_ORDER = 4  # model_runner_output.req_id_to_index (stored empty) is {req_ids[i]: i}


class AlignedStep(Step[int], tag="aligned_step"):
    """Format 1.4: a stored `Step` whose per-request maps are lists in the step's *batch order*:
    `scheduled_cached_reqs.req_ids`, then the new requests' ids. Our engine and vLLM's scheduler fill
    `num_scheduled_tokens` in that order, and the runner's output follows it, so the maps' keys repeat the order the
    step already holds. Storing them would cost a dict remap to handles per map per step on the recording thread,
    the largest part of writing a big decode step.

    Each part is left out only when it is exactly what the batch order rebuilds, key order included, so reading
    restores the step bit for bit; otherwise it is stored as in `Step`."""

    num_scheduled: list[int] | None = None  # num_scheduled_tokens' values in batch order (the map stored empty)
    elided: int = 0  # the bits above


class StepImage(msgspec.Struct, tag="step_image", array_like=True, omit_defaults=True):
    """Format 1.3: one step of another engine (vLLM) as that engine's objects, msgpack-encoded by its tap (maps of
    their fields, tensors as `Array`s, the rest as `Opaque`s): the writer stores them as they come, lossless and
    cheap, and the reader converts them into the contracts (`replay.contracts.image_decoder`). Only the logprob
    matrices move, into the chunk's `LogprobColumns` (the output's `logprobs` then holds the markers)."""

    index: int
    scheduler_output: msgspec.Raw  # the SchedulerOutput image
    model_runner_output: msgspec.Raw  # the ModelRunnerOutput image, or nil: the step ran nothing
    grammar_output: msgspec.Raw = msgspec.Raw(b"\xc0")  # the GrammarOutput image, or nil
    timing: StepTiming | None = None


class ColumnGroup(msgspec.Struct, array_like=True):
    """Logprob matrices of one kind (dtypes, number of columns) of a chunk's steps, rows in step order."""

    # [rows, k + 1]: column 0 the sampled token, 1.. the top-k (`replay.capture.codec.columns` filters)
    token_ids: Array
    logprobs: Array  # [rows, k + 1]
    ranks: Array  # [rows]: the sampled token's rank


class LogprobColumns(msgspec.Struct, tag="logprob_columns", array_like=True):
    """Format 1.3: the logprobs of every step of the chunk, stored column by column; first record of its chunk."""

    groups: list[ColumnGroup]


class Crash(msgspec.Struct, tag="crash", array_like=True, omit_defaults=True):
    """The engine raised while executing step `step`. Written just before that step's `Step` record, which holds what
    was scheduled (and the grammar bitmask) and no output: replay re-executes it and compares what it raises."""

    step: int
    error_type: str  # the exception's class name, e.g. "RuntimeError"
    message: str  # str(exception)
    traceback: str = ""  # the formatted traceback, as the engine's process printed it (for people; not compared)

    def describe(self) -> str:
        """'RuntimeError: CPU Generator does not use offset'."""
        return f"{self.error_type}: {self.message}" if self.message else self.error_type

    def status(self) -> str:
        """The footer status of a capture that ends with this crash."""
        return f"crashed at step {self.step}: {self.describe()}"[:500]

    @classmethod
    def from_exception(cls, step: int, error: BaseException) -> Crash:
        """The crash of step `step`, from the exception it raised (the traceback's last 8,000 characters)."""
        tb = "".join(traceback.format_exception(type(error), error, error.__traceback__))[-8000:]
        return cls(step, type(error).__name__, str(error), tb)


class Footer(msgspec.Struct, tag="footer", array_like=True, omit_defaults=True):
    """Last record of a cleanly closed capture."""

    num_steps: int
    num_records: int
    # "ok"; "engine stopped: ..." (the writer sealed it when the engine went away without closing: nothing lost);
    # "crashed at step N: <exception>"; "error: <why the recorder stopped>" (ENGINE_DIED: the engine itself);
    # "recovered from <file>: <what was lost>"
    status: str = "ok"


# The status of an engine that stopped on an error no step raised (its executor failed: a worker process died); a
# ring closed with it seals the window that led there, as it does a crash's.
ENGINE_DIED = "error: the engine died"


# Records as stored (request ids in steps are int handles). `Ids`, `LiveIds` and `LogprobColumns` never leave the
# reader.
WireRecord = (Header | RequestAdded | RequestAborted | Ids | LiveIds | LogprobColumns | Step[int] | PackedStep
              | AlignedStep | StepImage | Crash | Keyframe | Footer)
# Records as the reader yields them (ids resolved to vLLM's strings).
Record = Header | RequestAdded | RequestAborted | Step[str] | Crash | Keyframe | Footer
RECORD_TAGS = frozenset({"header", "request_added", "request_aborted", "ids", "live_ids", "logprob_columns", "step",
                         "packed_step", "aligned_step", "step_image", "crash", "keyframe", "footer"})
STEP_TAGS = ("step", "packed_step", "aligned_step", "step_image")


class ChunkInfo(msgspec.Struct, array_like=True, omit_defaults=True):
    """Where a chunk is and what it holds, so readers jump to a step and `info` answers from the index."""

    offset: int  # byte offset of the chunk's zstd frame
    length: int  # compressed bytes of the frame
    raw_size: int  # uncompressed bytes
    num_records: int
    first_step: int = -1  # -1 when the chunk holds no step
    last_step: int = -1
    num_steps: int = 0
    num_scheduled_tokens: int = 0
    num_generated_tokens: int = 0
    num_requests_added: int = 0
    # speculative decoding; trailing and omitted when 0, so a capture without drafts is what earlier versions wrote
    num_draft_tokens: int = 0  # draft tokens the chunk's steps scheduled for verification
    num_accepted_draft_tokens: int = 0
    keyframe: int = -1  # 1.6: the step of the chunk's Keyframe record (the state before it), -1 when it has none


class Index(msgspec.Struct, array_like=True, omit_defaults=True):
    """The seek index written at close (in a skippable frame) and by `recover`."""

    chunks: list[ChunkInfo]
    ids: list[str]  # every request-id handle of the capture, in handle order (empty from 1.5: see LiveIds)
    num_steps: int = 0
    status: str = "ok"  # the Footer's status
    num_requests: int = 0  # 1.5: requests recorded (the arrivals, or the requests its steps named, if more)


WIRE_ENCODER = msgspec.msgpack.Encoder()
WIRE_DECODER: msgspec.msgpack.Decoder = msgspec.msgpack.Decoder(WireRecord)
CHUNK_DECODER = msgspec.msgpack.Decoder(list[msgspec.Raw])
INDEX_DECODER = msgspec.msgpack.Decoder(Index)
