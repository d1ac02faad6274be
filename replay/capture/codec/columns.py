"""Logprob columns (format 1.3): a chunk's logprob matrices stored once per chunk, column by column.

Logprobs are most of a capture's bytes (top-5: 6 ids, 6 values and a rank per generated token). Stored step by
step, each step's small matrix is shuffled and compressed among the step's other fields; stored per chunk, every
column of every step in the chunk sits in one contiguous run (all top-1 values of the chunk, then all top-2 ...),
and the transforms run once per chunk, vectorised, instead of a dozen numpy calls per step in the writer.

A step's `LogprobsLists` then keeps its dtypes and shapes and no bytes: each of its arrays carries one filter,
`chunk-column:G:ROW`, meaning "rows ROW.. of column group G of this chunk's `LogprobColumns` record", which the
writer puts first in the chunk. Groups gather matrices of one kind (dtypes, number of columns). Transforms of a
group, all lossless and undone on read:
- token ids, column 0 (the sampled token, which usually repeats a top-k column): `col0-ref`, the index j >= 1 of
  the first column holding the same id, else the id + K (K columns), so it is 1 or 2 almost always;
- values, column 0: XOR with the bits of that same column (zeros then), as the per-step codec does;
- values, columns 2..: `row-delta`, the bits minus the previous column's bits (top-k values are sorted, so their
  sign, exponent and high mantissa bits mostly cancel): -4 % bytes measured on a vLLM capture;
- then column-major and byte-shuffled (token ids only when they fit in 16 bits, as per step).
"""

from __future__ import annotations

import numpy as np
from msgspec.structs import replace

from replay.capture.format.records import ColumnGroup, LogprobColumns
from replay.contracts import Array, LogprobsLists
from replay.contracts.arrays import FILTER_SHUFFLE, FILTER_TRANSPOSE, NUMPY_DTYPES

FILTER = "chunk-column"  # marker: f"chunk-column:{group}:{first_row}"
FILTER_COL0_REF = "col0-ref"
FILTER_COL0_XOR = "col0-xor-same-token"  # the per-step codec's name for the same transform
FILTER_ROW_DELTA = "row-delta"


def plain(a: Array) -> np.ndarray:
    """A read-only numpy view of an unfiltered array (no copy), else a decoded copy. ValueError when dtype, shape
    and bytes disagree (frombuffer and reshape check them: this runs three times per step in the writer)."""
    if a.filters:
        return a.to_numpy()
    dt = _DTYPES.get(a.dtype)
    if dt is None or -1 in a.shape:  # (reshape would infer a -1; any other negative size it refuses)
        a.validate()  # says what is wrong
    return np.frombuffer(a.data, dtype=dt).reshape(a.shape)


def _np_dtype(name: str) -> np.dtype:
    return _DTYPES[name]


_DTYPES = {name: np.dtype(spec) for name, spec in NUMPY_DTYPES.items()}


def same_token_column(ids: np.ndarray) -> np.ndarray:
    """Per row, the first column j >= 1 whose id equals column 0's, or 0 when there is none."""
    match = ids[:, 1:] == ids[:, :1]
    return np.where(match.any(axis=1), match.argmax(axis=1) + 1, 0)


def xor_col0_inplace(values: np.ndarray, ids: np.ndarray) -> None:
    """XOR column 0's bits with those of its same-token column: an involution, so it both packs and unpacks."""
    bits = values.view(np.dtype(f"<u{values.dtype.itemsize}"))
    j = same_token_column(ids)
    rows = np.flatnonzero(j)
    bits[rows, 0] ^= bits[rows, j[rows]]


def small_ids(ids: np.ndarray) -> bool:
    """Byte-shuffle token ids only when they all fit in 16 bits: then the high byte planes are all zeros and
    vanish (vocabularies up to 64k: -6 % on a 1k-vocab vLLM capture); with larger vocabularies the interleaved
    bytes compress better (+4 % if shuffled, capture_bench's 128k vocabulary)."""
    return ids.size > 0 and ids.dtype.itemsize > 2 and int(ids.min()) >= 0 and int(ids.max()) < 1 << 16


class ColumnSink:
    """The open chunk's logprob matrices, kept as the bytes they came in (no numpy per step), joined into columns at
    seal."""

    __slots__ = ("_groups", "_joined", "nbytes")

    def __init__(self) -> None:
        self._groups: dict[tuple, list] = {}  # kind -> [group number, rows so far, ids, values, ranks] (LE bytes)
        self._joined: dict[int, tuple] = {}  # group number -> its matrices joined (ids, values, ranks), once asked
        self.nbytes = 0  # raw bytes held, so that a chunk closes at its size with its columns counted

    def add(self, lp: LogprobsLists) -> LogprobsLists | None:
        """The step's `LogprobsLists` as stored (markers into this chunk's columns), or None for a matrix the
        columns do not take (another dtype or shape: the per-step codec stores it). ValueError when an array's bytes do
        not match its dtype and shape."""
        a, b, c = lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks
        if a.filters or b.filters or c.filters:
            taken = self.take(lp)
            return None if taken is None else taken[0]
        # the recorder's case: plain bytes, checked by length (no numpy per step: 3 views cost ~2 us)
        dtypes, shape = (a.dtype, b.dtype, c.dtype), tuple(a.shape)
        if len(shape) != 2 or tuple(b.shape) != shape or tuple(c.shape) != shape[:1]:
            return None
        where = self.take_bytes(dtypes, shape, (a.data, b.data, c.data))
        return None if where is None else markers(dtypes, shape, *where, lp.cu_num_generated_tokens)

    def take(self, lp: LogprobsLists) -> tuple[LogprobsLists, np.ndarray] | None:
        """`add`, also returning the token-id matrix as a view ([rows, K]: column 0 holds the sampled tokens)."""
        a, b, c = lp.logprob_token_ids, lp.logprobs, lp.sampled_token_ranks
        shape = tuple(a.shape)
        if not _fits(shape, (a.dtype, b.dtype, c.dtype)) or tuple(b.shape) != shape or tuple(c.shape) != shape[:1]:
            return None
        ids, vals, ranks = plain(a), plain(b), plain(c)  # all three checked before any joins the group (ValueError)
        data = [x.data if not x.filters else np.ascontiguousarray(v).tobytes() for x,
                v in ((a, ids), (b, vals), (c, ranks))]
        g, row = self._append((a.dtype, b.dtype, c.dtype, shape[1]), shape[0], data)
        return markers((a.dtype, b.dtype, c.dtype), shape, g, row, lp.cu_num_generated_tokens), ids

    def take_bytes(self, dtypes: tuple[str, str, str], shape: tuple[int, int],
                   arrays: tuple[bytes, bytes, bytes]) -> tuple[int, int] | None:
        """A step's matrices given as little-endian bytes (token ids [rows, K], logprobs [rows, K], ranks [rows]): where
        they start in the columns (group, row), or None for a dtype or shape the columns do not take. ValueError when
        the bytes do not fit the shape. Nothing is decoded: the writer's common step is a few length checks."""
        if not _fits(shape, dtypes) or dtypes[1] not in _DTYPES:
            return None
        rows, k = shape
        sizes = [_DTYPES[d].itemsize for d in dtypes]
        if (len(arrays[0]) != rows * k * sizes[0] or len(arrays[1]) != rows * k * sizes[1]
                or len(arrays[2]) != rows * sizes[2]):
            raise ValueError(f"logprob matrices of {rows}x{k} {'/'.join(dtypes)} do not fit their bytes")
        return self._append((*dtypes, k), rows, arrays)

    def _append(self, key: tuple, rows: int, data) -> tuple[int, int]:
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = [len(self._groups), 0, [], [], []]
        g[2].append(data[0])
        g[3].append(data[1])
        g[4].append(data[2])
        where = g[0], g[1]
        g[1] += rows
        self.nbytes += len(data[0]) + len(data[1]) + len(data[2])
        return where

    def token_ids(self, group: int) -> np.ndarray:
        """Group `group`'s token-id matrix so far ([rows, K]; column 0: the sampled tokens), joined once."""
        return self._matrices(group)[0]

    def _matrices(self, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key, g = next((key, g) for key, g in self._groups.items() if g[0] == group)
        joined = self._joined.get(group)
        if joined is None or joined[3] != g[1]:
            a, b, c, k = key
            joined = self._joined[group] = (
                np.frombuffer(b"".join(g[2]), _DTYPES[a]).reshape(-1, k),
                np.frombuffer(b"".join(g[3]), _DTYPES[b]).reshape(-1, k),
                np.frombuffer(b"".join(g[4]), _DTYPES[c]), g[1])
        return joined[:3]

    def seal(self) -> LogprobColumns | None:
        """The chunk's `LogprobColumns` record (None when no step had logprobs); the sink is empty afterwards."""
        if not self._groups:
            return None
        groups = sorted(self._groups.items(), key=lambda kv: kv[1][0])
        record = LogprobColumns([_pack(key, *self._matrices(g[0])) for key, g in groups])
        self._groups, self._joined, self.nbytes = {}, {}, 0
        return record


_INT = frozenset({"int8", "uint8", "int16", "uint16", "int32", "int64"})


def _fits(shape: tuple, dtypes: tuple[str, str, str]) -> bool:
    """Whether matrices of this shape and these dtypes (ids, values, ranks) go into the columns."""
    return len(shape) == 2 and shape[0] > 0 and shape[1] > 0 and dtypes[0] in _INT and dtypes[2] in _INT \
        and dtypes[1] not in _INT


def markers(dtypes: tuple[str, str, str], shape: tuple[int, int], group: int, row: int,
            cu_num_generated_tokens: list[int] | None) -> LogprobsLists:
    """The `LogprobsLists` a step stores for rows `row..` of column group `group`: dtypes and shapes, no bytes."""
    marker = (f"{FILTER}:{group}:{row}",)
    return LogprobsLists(Array(dtypes[0], shape, b"", marker), Array(dtypes[1], shape, b"", marker),
                         Array(dtypes[2], shape[:1], b"", marker), cu_num_generated_tokens)


def _pack(kind: tuple, ids_rows: np.ndarray, vals_rows: np.ndarray, ranks: np.ndarray) -> ColumnGroup:
    """A group's matrices ([rows, K], [rows, K], [rows]; `kind`: their dtype names and K) as stored. It works on
    contiguous columns ([K, rows]): the same transforms on the row-major matrix took twice as long (reductions and
    strides along rows of K)."""
    ids = ids_rows.T.copy()  # [K, rows], C order: the chunk's own copy, transformed in place
    vals = vals_rows.T.copy()
    k, rows = ids.shape
    id_filters, val_filters = (), ()
    if k >= 2:
        same = np.zeros(rows, np.intp)  # per row, the first column j >= 1 holding column 0's id, else 0
        for j in range(k - 1, 0, -1):
            np.copyto(same, j, where=ids[j] == ids[0])  # (a masked copy: faster than same[mask] = j)
        bits = vals.view(np.dtype(f"<u{vals.dtype.itemsize}"))
        # values column 0 XOR its same-token column (zeros then): one gather, not a boolean-mask gather and scatter
        # per column
        partner = np.take_along_axis(bits, same[np.newaxis], axis=0)[0]  # (column 0 itself where same == 0)
        np.bitwise_xor(bits[0], partner, out=bits[0], where=same > 0)
        val_filters += (FILTER_COL0_XOR,)
        if k >= 3:
            bits[2:] -= bits[1:-1].copy()  # wraps, reversible: a cumulative sum undoes it
            val_filters += (FILTER_ROW_DELTA,)
        col0 = ids[0].astype(np.int64)
        literal = col0 + k
        if int(col0.min()) >= 0 and int(literal.max()) <= np.iinfo(ids.dtype).max:
            ids[0] = np.where(same > 0, same, literal).astype(ids.dtype)
            id_filters += (FILTER_COL0_REF,)
    return ColumnGroup(_column_major(kind[0], ids, small_ids(ids), id_filters),
                       _column_major(kind[1], vals, True, val_filters), Array.from_numpy(ranks, shuffle=True))


def _column_major(dtype: str, columns: np.ndarray, shuffle: bool, extra: tuple[str, ...]) -> Array:
    """[K, rows] contiguous columns stored as `Array.from_numpy(matrix, transpose=True, shuffle=...)` stores the
    [rows, K] matrix: column by column, and with `shuffle` byte plane by byte plane (plane, column, row)."""
    k, rows = columns.shape
    if not shuffle or columns.dtype.itemsize == 1:
        return Array(dtype, (rows, k), columns.tobytes(), (FILTER_TRANSPOSE,) + extra)
    planes = columns.view(np.uint8).reshape(k, rows, columns.dtype.itemsize).transpose(2, 0, 1)
    return Array(dtype, (rows, k), np.ascontiguousarray(planes).tobytes(), (FILTER_TRANSPOSE, FILTER_SHUFFLE) + extra)


def _strip(a: Array, names: tuple[str, ...]) -> tuple[Array, set[str]]:
    own = {f for f in a.filters if f in names}
    return (replace(a, filters=tuple(f for f in a.filters if f not in names)) if own else a), own


def _unpack(g: ColumnGroup) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids_a, id_f = _strip(g.token_ids, (FILTER_COL0_REF,))
    vals_a, val_f = _strip(g.logprobs, (FILTER_COL0_XOR, FILTER_ROW_DELTA))
    ids, vals, ranks = ids_a.to_numpy(), vals_a.to_numpy(), g.ranks.to_numpy()
    if ids.ndim != 2 or vals.shape != ids.shape or ranks.shape != (ids.shape[0],):
        raise ValueError("logprob columns of different lengths")
    k = ids.shape[1]
    if FILTER_COL0_REF in id_f:
        code = ids[:, 0].astype(np.int64)
        ref = (code >= 1) & (code < k)
        ids[:, 0] = np.where(ref, ids[np.arange(len(ids)), np.where(ref, code, 0)], code - k).astype(ids.dtype)
    if val_f:
        bits = vals.view(np.dtype(f"<u{vals.dtype.itemsize}"))
        if FILTER_ROW_DELTA in val_f:
            bits[:, 1:] = np.cumsum(bits[:, 1:], axis=1, dtype=bits.dtype)  # wraps as the subtraction did
        if FILTER_COL0_XOR in val_f:
            xor_col0_inplace(vals, ids)
    return ids, vals, ranks


class ColumnSource:
    """One chunk's `LogprobColumns`, unpacked on first use, handing each step its rows back."""

    def __init__(self, record: LogprobColumns):
        self._record = record
        self._groups: list | None = None

    def fill(self, lp: LogprobsLists) -> LogprobsLists:
        """A stored `LogprobsLists` with its arrays back (ValueError when its markers point outside the columns)."""
        marker = lp.logprob_token_ids.filters[0]
        try:
            _, g, row = marker.split(":")
            g, row = int(g), int(row)
        except ValueError:
            raise ValueError(f"malformed logprob-column marker {marker!r}") from None
        if self._groups is None:
            self._groups = [_unpack(x) for x in self._record.groups]
        if not 0 <= g < len(self._groups):
            raise ValueError(f"logprob column group {g} is not in its chunk")
        ids, vals, ranks = self._groups[g]
        kinds = self._record.groups[g]
        n = lp.logprob_token_ids.shape[0]
        if row < 0 or row + n > len(ids) or tuple(lp.logprob_token_ids.shape) != (n, ids.shape[1]):
            raise ValueError(f"logprob rows {row}..{row + n} are not in their column group")
        out = []
        for stored, col, kind in ((lp.logprob_token_ids, ids, kinds.token_ids), (lp.logprobs, vals, kinds.logprobs),
                                  (lp.sampled_token_ranks, ranks, kinds.ranks)):
            if stored.dtype != kind.dtype:
                raise ValueError("a logprob marker's dtype differs from its column group's")
            le = np.ascontiguousarray(col[row:row + n], dtype=_np_dtype(kind.dtype))
            out.append(Array(stored.dtype, tuple(stored.shape), le.tobytes()))
        return replace(lp, logprob_token_ids=out[0], logprobs=out[1], sampled_token_ranks=out[2])


def is_marker(a: Array) -> bool:
    """Whether a stored array lives in its chunk's logprob columns."""
    return bool(a.filters) and a.filters[0].startswith(FILTER + ":")

