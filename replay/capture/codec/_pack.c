/* A chunk's logprob column group, packed in one pass per output (`replay.capture.columns._pack` wraps it).
 *
 * Why: the numpy form of the same transforms is a dozen array calls and as many fresh arrays on a chunk's ~16k rows
 * x 6 columns, on the recording thread (it seals the chunk). Measured in a writer's sequence of seals (top-5
 * workload): ~0.8-1.2 ms a seal here against ~1.9 ms for numpy, itself down from 2.5-2.8 ms before its XOR became one
 * gather; hot, on the same matrices, the two are close (~0.3 ms): the gain is the memory numpy allocates and touches.
 * Here each output is written once, in the order it is stored.
 *
 * The bytes are exactly the numpy path's (tests/capture/test_pack.py compares both), for K >= 2 columns:
 * - token ids ([rows, K], int8..int64): column 0 becomes `col0-ref` (the first column j >= 1 holding the same id,
 *   else id + K) where every id >= 0 and id + K fits the dtype (+K computed as numpy does, in int64, wrapping);
 *   then column-major, byte-shuffled (plane, column, row) when every stored id is in [0, 2^16) and ids are wider
 *   than 2 bytes, else plain column-major;
 * - values ([rows, K], 2-, 4- or 8-byte floats, as their bits): column 0 XOR the bits of its same-token column
 *   (where there is one), columns 2.. minus the previous column's bits (modulo 2^bits), column-major, shuffled;
 * - ranks ([rows], any integer width): shuffled (plane, row) when wider than a byte.
 * Little-endian hosts only (the stored bytes are little-endian): elsewhere the module offers no pack.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int64_t int_max(int size, int is_signed) {
    if (size == 8) return INT64_MAX;  /* (uint64 is not a stored id dtype) */
    return is_signed ? (INT64_C(1) << (8 * size - 1)) - 1 : (INT64_C(1) << (8 * size)) - 1;
}

/* Item i of an array of little-endian integers of `size` bytes, widened (sign-extended where `is_signed`). */
static inline __attribute__((always_inline)) int64_t item(const unsigned char *p, Py_ssize_t i, int size, int is_signed) {
    switch (size) {
    case 1: return is_signed ? (int64_t)(int8_t)p[i] : (int64_t)p[i];
    case 2: { uint16_t u; memcpy(&u, p + 2 * i, 2); return is_signed ? (int64_t)(int16_t)u : (int64_t)u; }
    case 4: { uint32_t u; memcpy(&u, p + 4 * i, 4); return is_signed ? (int64_t)(int32_t)u : (int64_t)u; }
    default: { int64_t s; memcpy(&s, p + 8 * i, 8); return s; }
    }
}

/* Value v at place `at` of `count` items, `size` low bytes: byte-shuffled (byte b in plane b) or a little-endian item. */
static inline __attribute__((always_inline)) void put(unsigned char *out, Py_ssize_t count, Py_ssize_t at, uint64_t v, int size, int shuffle) {
    if (!shuffle) {
        memcpy(out + at * size, &v, (size_t)size);  /* (a little-endian host: the low bytes come first) */
        return;
    }
    switch (size) {
    case 8: out[7 * count + at] = (unsigned char)(v >> 56); out[6 * count + at] = (unsigned char)(v >> 48);
            out[5 * count + at] = (unsigned char)(v >> 40); out[4 * count + at] = (unsigned char)(v >> 32); /* fall through */
    case 4: out[3 * count + at] = (unsigned char)(v >> 24); out[2 * count + at] = (unsigned char)(v >> 16); /* fall through */
    case 2: out[count + at] = (unsigned char)(v >> 8); /* fall through */
    default: out[at] = (unsigned char)v;
    }
}

/* The second pass: every output, in place (inlined twice, so that the common sizes are constants). */
static inline __attribute__((always_inline)) void store(
        unsigned char *io, unsigned char *vo, unsigned char *ro, const unsigned char *ids, const unsigned char *vals,
        const unsigned char *ranks, const int32_t *same, Py_ssize_t rows, Py_ssize_t k, int id_size, int id_signed,
        int val_size, int rank_size, int ref, int shuffle_ids) {
    Py_ssize_t n = rows * k;
    for (Py_ssize_t r = 0; r < rows; r++) {  /* stored column-major: item (row r, column c) at c * rows + r */
        int64_t c0 = item(ids, r * k, id_size, id_signed);
        put(io, n, r, (uint64_t)(!ref ? c0 : same[r] ? same[r] : (int64_t)((uint64_t)c0 + (uint64_t)k)), id_size,
            shuffle_ids);
        for (Py_ssize_t c = 1; c < k; c++)
            put(io, n, c * rows + r, (uint64_t)item(ids, r * k + c, id_size, id_signed), id_size, shuffle_ids);
        /* values as bits: column 0 XOR its same-token column's; columns 2.. minus the previous column's (as given) */
        uint64_t prev = (uint64_t)item(vals, r * k + 1, val_size, 0), v0 = (uint64_t)item(vals, r * k, val_size, 0);
        if (same[r]) v0 ^= (uint64_t)item(vals, r * k + same[r], val_size, 0);
        put(vo, n, r, v0, val_size, 1);
        put(vo, n, rows + r, prev, val_size, 1);
        for (Py_ssize_t c = 2; c < k; c++) {
            uint64_t v = (uint64_t)item(vals, r * k + c, val_size, 0);
            put(vo, n, c * rows + r, v - prev, val_size, 1);  /* (only the low bytes are kept: modulo 2^bits) */
            prev = v;
        }
        put(ro, rows, r, (uint64_t)item(ranks, r, rank_size, 0), rank_size, rank_size > 1);
    }
}

/* pack_group(ids, vals, ranks, rows, k, id_size, id_signed, val_size, rank_size)
 *   -> (ids bytes, ids shuffled, col0-ref applied, values bytes, ranks bytes, ranks shuffled)
 * Two passes over the ids (what column 0 and the shuffle become depends on every row) and one over the values, in
 * place: no temporary copy of the matrices (fresh memory's page faults cost more than the arithmetic). */
static PyObject *pack_group(PyObject *self, PyObject *args) {
    Py_buffer ib, vb, rb;
    Py_ssize_t rows, k;
    int id_size, id_signed, val_size, rank_size;
    if (!PyArg_ParseTuple(args, "y*y*y*nnipii", &ib, &vb, &rb, &rows, &k, &id_size, &id_signed, &val_size, &rank_size))
        return NULL;
    PyObject *result = NULL, *ids_out = NULL, *vals_out = NULL, *ranks_out = NULL;
    int32_t *same = NULL;
    int sizes_ok = (id_size == 1 || id_size == 2 || id_size == 4 || id_size == 8) &&
                   (val_size == 2 || val_size == 4 || val_size == 8) &&
                   (rank_size == 1 || rank_size == 2 || rank_size == 4 || rank_size == 8);
    if (!sizes_ok || rows <= 0 || k < 2 || k > INT32_MAX || ib.len != rows * k * id_size ||
        vb.len != rows * k * val_size || rb.len != rows * rank_size) {
        PyErr_SetString(PyExc_ValueError, "logprob matrices that do not fit their shape");
        goto done;
    }
    const unsigned char *ids = ib.buf, *vals = vb.buf, *ranks = rb.buf;
    Py_ssize_t n = rows * k;
    same = PyMem_Malloc((size_t)rows * sizeof *same);
    if (same == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    /* col0-ref applies only if every id of column 0 is >= 0 and id + k fits the dtype (numpy's int64 add wraps);
     * the ids are shuffled only if all of them as stored (column 0 either way) are in [0, 2^16) */
    int64_t col0_min = INT64_MAX, col0_max = INT64_MIN, lit_max = INT64_MIN;  /* column 0 as given */
    int64_t ref_lo = INT64_MAX, ref_hi = INT64_MIN;  /* column 0 as col0-ref stores it */
    int64_t lo = INT64_MAX, hi = INT64_MIN;  /* the other columns */
    for (Py_ssize_t r = 0; r < rows; r++) {
        int64_t c0 = item(ids, r * k, id_size, id_signed), literal = (int64_t)((uint64_t)c0 + (uint64_t)k);
        int32_t j = 0;
        for (Py_ssize_t c = 1; c < k; c++) {
            int64_t v = item(ids, r * k + c, id_size, id_signed);
            if (v < lo) lo = v;
            if (v > hi) hi = v;
            if (!j && v == c0) j = (int32_t)c;
        }
        same[r] = j;
        int64_t stored = j ? j : literal;
        if (c0 < col0_min) col0_min = c0;
        if (c0 > col0_max) col0_max = c0;
        if (literal > lit_max) lit_max = literal;
        if (stored < ref_lo) ref_lo = stored;
        if (stored > ref_hi) ref_hi = stored;
    }
    int ref = col0_min >= 0 && lit_max <= int_max(id_size, id_signed);
    int64_t min_all = ref ? ref_lo : col0_min, max_all = ref ? ref_hi : col0_max;
    if (lo < min_all) min_all = lo;
    if (hi > max_all) max_all = hi;
    int shuffle_ids = id_size > 2 && min_all >= 0 && max_all < (INT64_C(1) << 16);
    ids_out = PyBytes_FromStringAndSize(NULL, n * id_size);
    vals_out = PyBytes_FromStringAndSize(NULL, n * val_size);
    ranks_out = PyBytes_FromStringAndSize(NULL, rows * rank_size);
    if (ids_out == NULL || vals_out == NULL || ranks_out == NULL) goto done;
    unsigned char *io = (unsigned char *)PyBytes_AS_STRING(ids_out);
    unsigned char *vo = (unsigned char *)PyBytes_AS_STRING(vals_out);
    unsigned char *ro = (unsigned char *)PyBytes_AS_STRING(ranks_out);
    if (id_size == 4 && val_size == 4 && rank_size == 8)  /* (vLLM's and our runner's: int32, float32, int64) */
        store(io, vo, ro, ids, vals, ranks, same, rows, k, 4, 1, 4, 8, ref, shuffle_ids);
    else
        store(io, vo, ro, ids, vals, ranks, same, rows, k, id_size, id_signed, val_size, rank_size, ref, shuffle_ids);
    result = Py_BuildValue("(OiiOOi)", ids_out, shuffle_ids, ref, vals_out, ranks_out, rank_size > 1);
done:
    Py_XDECREF(ids_out);
    Py_XDECREF(vals_out);
    Py_XDECREF(ranks_out);
    PyMem_Free(same);
    PyBuffer_Release(&ib);
    PyBuffer_Release(&vb);
    PyBuffer_Release(&rb);
    return result;
}

static PyMethodDef methods[] = {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    {"pack_group", pack_group, METH_VARARGS, "A logprob column group's stored bytes (see the module's comment)."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_pack", "Compiled logprob column packing (see columns).", -1,
                                    methods};

PyMODINIT_FUNC PyInit__pack(void) { return PyModule_Create(&module); }
