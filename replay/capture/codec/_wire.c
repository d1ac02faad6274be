/* The recording thread's per-request passes over a step, compiled (`replay.capture.fastwire` wraps them).
 *
 * Why: a 256-request decode step is ~18 passes of 256 elements in Python builtins (map, list(), ==, sum, msgspec's
 * encode), about 70 us a step of capture_bench's builtin write path. Here each column is one C pass that writes
 * its msgpack bytes directly, byte for byte what msgspec writes for the same list (ints in their narrowest form,
 * arrays with fixarray/array16/array32 heads), so a step stores the same bytes whichever path made them.
 *
 * Anything these functions do not take as msgspec would (a bool, a float, an int beyond 64 bits, an object that
 * is not a list or tuple) raises TypeError or OverflowError; the caller then takes the Python path for the step.
 *
 * One more pass serves the writer process's image steps (`image_batch`): whether a step's sampled-token image is
 * its logprob rows' column 0, one token a row, compared byte by byte without building the list (`one_token_rows`).
 *
 * Ints are read without a call where CPython stores them in one digit (|x| < 2**30: every id, count and token),
 * and each array's room is reserved once: the passes are bound by the cache misses of a step's objects.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Buf;

static int buf_reserve(Buf *b, Py_ssize_t more) {
    if (b->n + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + more) cap *= 2;
    char *p = PyMem_Realloc(b->p, cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static void put_be(char *at, uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; i--) {
        at[i] = (char)(v & 0xFF);
        v >>= 8;
    }
}

/* msgpack's array head for n elements, as msgspec writes it. */
static int put_array_head(Buf *b, Py_ssize_t n) {
    if (buf_reserve(b, 5) < 0) return -1;
    char *at = b->p + b->n;
    if (n < 16) {
        at[0] = (char)(0x90 | n);
        b->n += 1;
    } else if (n < 65536) {
        at[0] = (char)0xDC;
        put_be(at + 1, (uint64_t)n, 2);
        b->n += 3;
    } else {
        at[0] = (char)0xDD;
        put_be(at + 1, (uint64_t)n, 4);
        b->n += 5;
    }
    return 0;
}

static void put_i64(Buf *b, long long v) { /* room for 9 bytes already reserved */
    char *at = b->p + b->n;
    if (v >= 0) {
        uint64_t u = (uint64_t)v;
        if (u < 128) { at[0] = (char)u; b->n += 1; }
        else if (u < 256) { at[0] = (char)0xCC; put_be(at + 1, u, 1); b->n += 2; }
        else if (u < 65536) { at[0] = (char)0xCD; put_be(at + 1, u, 2); b->n += 3; }
        else if (u < 4294967296ULL) { at[0] = (char)0xCE; put_be(at + 1, u, 4); b->n += 5; }
        else { at[0] = (char)0xCF; put_be(at + 1, u, 8); b->n += 9; }
    } else if (v >= -32) { at[0] = (char)(v & 0xFF); b->n += 1; }
    else if (v >= -128) { at[0] = (char)0xD0; put_be(at + 1, (uint64_t)v, 1); b->n += 2; }
    else if (v >= -32768) { at[0] = (char)0xD1; put_be(at + 1, (uint64_t)v, 2); b->n += 3; }
    else if (v >= -2147483648LL) { at[0] = (char)0xD2; put_be(at + 1, (uint64_t)v, 4); b->n += 5; }
    else { at[0] = (char)0xD3; put_be(at + 1, (uint64_t)v, 8); b->n += 9; }
}

/* A compact int's value (one 30-bit digit or none: |x| < 2**30, every token id and count here) without a call;
 * 0 when `x` is not compact (the general path below handles it). */
static inline int compact_value(PyObject *x, long long *v) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)x)) return 0;
    *v = (long long)PyUnstable_Long_CompactValue((PyLongObject *)x);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(x);
    if (size < -1 || size > 1) return 0;
    *v = size * (long long)((PyLongObject *)x)->ob_digit[0];
    return 1;
#endif
}

/* One Python int as msgspec encodes it: int64, or uint64 beyond. Exact ints only (a bool is encoded otherwise).
 * The caller has reserved 9 bytes. */
static int put_int_reserved(Buf *b, PyObject *x) {
    if (!PyLong_CheckExact(x)) {
        PyErr_SetString(PyExc_TypeError, "not an int");
        return -1;
    }
    long long v;
    if (compact_value(x, &v)) {
        put_i64(b, v);
        return 0;
    }
    int overflow = 0;
    v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow == 0) {
        if (v == -1 && PyErr_Occurred()) return -1;
        put_i64(b, v);
        return 0;
    }
    if (overflow < 0) {
        PyErr_SetString(PyExc_OverflowError, "int below int64");
        return -1;
    }
    unsigned long long u = PyLong_AsUnsignedLongLong(x);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) return -1; /* beyond uint64: OverflowError */
    char *at = b->p + b->n;
    at[0] = (char)0xCF;
    put_be(at + 1, (uint64_t)u, 8);
    b->n += 9;
    return 0;
}

static PyObject *finish(Buf *b) {
    PyObject *out = PyBytes_FromStringAndSize(b->p, b->n);
    PyMem_Free(b->p);
    return out;
}

static PyObject *fail(Buf *b) {
    PyMem_Free(b->p);
    return NULL;
}

/* A list or tuple's items (borrowed) and count; TypeError for anything else (msgspec's encode would differ). */
static int items_of(PyObject *seq, PyObject ***items, Py_ssize_t *n) {
    if (PyList_CheckExact(seq)) {
        *items = ((PyListObject *)seq)->ob_item;
        *n = PyList_GET_SIZE(seq);
        return 0;
    }
    if (PyTuple_CheckExact(seq)) {
        *items = ((PyTupleObject *)seq)->ob_item;
        *n = PyTuple_GET_SIZE(seq);
        return 0;
    }
    PyErr_SetString(PyExc_TypeError, "not a list or tuple");
    return -1;
}

static PyObject *int_array(PyObject *self, PyObject *seq) {
    PyObject **items;
    Py_ssize_t n;
    Buf b = {0};
    if (items_of(seq, &items, &n) < 0 || put_array_head(&b, n) < 0 || buf_reserve(&b, 9 * n) < 0) return fail(&b);
    for (Py_ssize_t i = 0; i < n; i++)
        if (put_int_reserved(&b, items[i]) < 0) return fail(&b);
    return finish(&b);
}

/* The dict's int values, encoded, when its keys in order are `order` (each key `is` or == its entry); None when
 * they are not. One pass: a step's num_scheduled_tokens against its batch order. */
static PyObject *ordered_values(PyObject *self, PyObject *args) {
    PyObject *d, *order, **items;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OO", &d, &order)) return NULL;
    if (!PyDict_CheckExact(d)) {
        PyErr_SetString(PyExc_TypeError, "not a dict");
        return NULL;
    }
    if (items_of(order, &items, &n) < 0) return NULL;
    if (PyDict_GET_SIZE(d) != n) Py_RETURN_NONE;
    Buf b = {0};
    if (put_array_head(&b, n) < 0 || buf_reserve(&b, 9 * n) < 0) return fail(&b);
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(d, &pos, &key, &value)) {
        if (key != items[i]) {
            int eq = PyObject_RichCompareBool(key, items[i], Py_EQ);
            if (eq < 0) return fail(&b);
            if (eq == 0) {
                PyMem_Free(b.p);
                Py_RETURN_NONE;
            }
        }
        if (put_int_reserved(&b, value) < 0) return fail(&b);
        i++;
    }
    return finish(&b);
}

static PyObject *handle_array(PyObject *self, PyObject *args) {
    PyObject *ids, *handles, **items;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OO", &ids, &handles)) return NULL;
    Buf b = {0};
    if (items_of(ids, &items, &n) < 0 || put_array_head(&b, n) < 0 || buf_reserve(&b, 9 * n) < 0) return fail(&b);
    int plain = PyDict_Check(handles);
    for (Py_ssize_t i = 0; i < n; i++) {
        /* a dict (whose subclass interns on a miss, `__missing__`): the lookup without the mapping protocol's
         * dispatch; a miss goes through it */
        PyObject *h = plain ? PyDict_GetItemWithError(handles, items[i]) : NULL;
        if (h != NULL) {
            if (put_int_reserved(&b, h) < 0) return fail(&b);
            continue;
        }
        if (PyErr_Occurred()) return fail(&b);
        h = PyObject_GetItem(handles, items[i]);
        if (h == NULL) return fail(&b);
        int bad = put_int_reserved(&b, h);
        Py_DECREF(h);
        if (bad < 0) return fail(&b);
    }
    return finish(&b);
}

static PyObject *diff_array(PyObject *self, PyObject *args) {
    PyObject *a, *c, **xs, **ys;
    Py_ssize_t n, m;
    if (!PyArg_ParseTuple(args, "OO", &a, &c)) return NULL;
    Buf b = {0};
    if (items_of(a, &xs, &n) < 0 || items_of(c, &ys, &m) < 0) return fail(&b);
    if (n != m) {
        PyErr_SetString(PyExc_ValueError, "lists of different lengths");
        return fail(&b);
    }
    if (put_array_head(&b, n) < 0 || buf_reserve(&b, 9 * n) < 0) return fail(&b);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(xs[i]) || !PyLong_CheckExact(ys[i])) {
            PyErr_SetString(PyExc_TypeError, "not an int");
            return fail(&b);
        }
        int o1 = 0, o2 = 0;
        long long x, y, d;
        if (!compact_value(xs[i], &x)) x = PyLong_AsLongLongAndOverflow(xs[i], &o1);
        if (!compact_value(ys[i], &y)) y = PyLong_AsLongLongAndOverflow(ys[i], &o2);
        if (o1 || o2 || __builtin_sub_overflow(x, y, &d)) { /* the Python path handles big ints */
            PyErr_SetString(PyExc_OverflowError, "beyond int64");
            return fail(&b);
        }
        put_i64(&b, d);
    }
    return finish(&b);
}

static PyObject *token_lists(PyObject *self, PyObject *seq) {
    PyObject **rows;
    Py_ssize_t n, total = 0;
    Buf b = {0};
    if (items_of(seq, &rows, &n) < 0 || put_array_head(&b, n) < 0) return fail(&b);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject **items;
        Py_ssize_t k;
        if (items_of(rows[i], &items, &k) < 0 || put_array_head(&b, k) < 0 || buf_reserve(&b, 9 * k) < 0)
            return fail(&b);
        for (Py_ssize_t j = 0; j < k; j++)
            if (put_int_reserved(&b, items[j]) < 0) return fail(&b);
        total += k;
    }
    PyObject *data = finish(&b);
    if (data == NULL) return NULL;
    return Py_BuildValue("(Nn)", data, total);
}

/* Whether `d` is {ids[i]: i}, in that order (one pass: keys and values together). */
static PyObject *is_index(PyObject *self, PyObject *args) {
    PyObject *d, *ids, **items;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OO", &d, &ids)) return NULL;
    if (!PyDict_CheckExact(d)) {
        PyErr_SetString(PyExc_TypeError, "not a dict");
        return NULL;
    }
    if (items_of(ids, &items, &n) < 0) return NULL;
    if (PyDict_GET_SIZE(d) != n) Py_RETURN_FALSE;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(d, &pos, &key, &value)) {
        long long v;
        if (!PyLong_CheckExact(value)) Py_RETURN_FALSE;
        if (!compact_value(value, &v)) {
            int overflow = 0;
            v = PyLong_AsLongLongAndOverflow(value, &overflow);
            if (overflow) Py_RETURN_FALSE;
        }
        if (v != i) Py_RETURN_FALSE;
        if (key != items[i]) {
            int eq = PyObject_RichCompareBool(key, items[i], Py_EQ);
            if (eq < 0) return NULL;
            if (eq == 0) Py_RETURN_FALSE;
        }
        i++;
    }
    Py_RETURN_TRUE;
}

/* Whether `tokens` (msgpack bytes) is what msgspec writes for [[ids[r, 0]] for r in row..row+n-1]: a step's sampled
 * tokens, one a row, equal to its logprob rows' column 0 (the vLLM tap's common step). `ids` is a 2-D buffer of
 * integers (the chunk's token-id matrix, any strides); TypeError for another layout (the caller checks in Python). */
static PyObject *one_token_rows(PyObject *self, PyObject *args) {
    Py_buffer t, m;
    PyObject *ids;
    Py_ssize_t row, n;
    if (!PyArg_ParseTuple(args, "y*Onn", &t, &ids, &row, &n)) return NULL;
    if (PyObject_GetBuffer(ids, &m, PyBUF_RECORDS_RO) < 0) {
        PyBuffer_Release(&t);
        return NULL;
    }
    PyObject *result = NULL;
    const char *f = m.format ? m.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    char kind = f[0];
    int is_signed = kind == 'b' || kind == 'h' || kind == 'i' || kind == 'l' || kind == 'q';
    int known = is_signed || kind == 'B' || kind == 'H' || kind == 'I' || kind == 'L' || kind == 'Q';
    if (m.ndim != 2 || !known || f[1] != '\0' || (m.itemsize != 1 && m.itemsize != 2 && m.itemsize != 4 && m.itemsize != 8)) {
        PyErr_SetString(PyExc_TypeError, "not a 2-D integer matrix");
        goto done;
    }
    if (row < 0 || n < 0 || row + n > m.shape[0] || m.shape[1] < 1) {
        PyErr_SetString(PyExc_ValueError, "rows beyond the matrix");
        goto done;
    }
    const unsigned char *at = t.buf, *end = at + t.len;
    char head[9];
    Buf b = {head, 0, sizeof head};
    put_array_head(&b, n);
    int same = t.len >= b.n && memcmp(at, head, b.n) == 0;
    at += b.n;
    for (Py_ssize_t r = row; same && r < row + n; r++) {
        const char *x = (const char *)m.buf + r * m.strides[0];
        long long v = 0;
        unsigned long long u = 0;
        int big = 0;
        /* (memcpy: a buffer's items need not be aligned) */
        switch (m.itemsize) {
        case 1: { int8_t s8; uint8_t u8; memcpy(&s8, x, 1); memcpy(&u8, x, 1); v = is_signed ? s8 : u8; break; }
        case 2: { int16_t s16; uint16_t u16; memcpy(&s16, x, 2); memcpy(&u16, x, 2); v = is_signed ? s16 : u16; break; }
        case 4: {
            int32_t s32; uint32_t u32;
            memcpy(&s32, x, 4); memcpy(&u32, x, 4);
            v = is_signed ? (long long)s32 : (long long)u32;
            break;
        }
        default:
            memcpy(&u, x, 8);
            if (is_signed) { int64_t s64; memcpy(&s64, x, 8); v = s64; u = 0; }
            else { big = u > (unsigned long long)INT64_MAX; v = (long long)u; }
        }
        char one[10];
        Buf e = {one, 1, sizeof one};
        one[0] = (char)0x91;
        if (big) {
            one[1] = (char)0xCF;
            put_be(one + 2, u, 8);
            e.n = 10;
        } else {
            put_i64(&e, v);
        }
        same = end - at >= e.n && memcmp(at, one, e.n) == 0;
        at += e.n;
    }
    result = PyBool_FromLong(same && at == end);
done:
    PyBuffer_Release(&m);
    PyBuffer_Release(&t);
    return result;
}

/* (int_array's bytes, a tuple of the very items encoded): one pass, so each int is touched once, for a prompt kept
 * at its arrival (`prompts`) whose items must stay alive for `same_items` to mean what it says. */
static PyObject *int_array_held(PyObject *self, PyObject *seq) {
    PyObject **items;
    Py_ssize_t n;
    Buf b = {0};
    if (items_of(seq, &items, &n) < 0 || put_array_head(&b, n) < 0 || buf_reserve(&b, 9 * n) < 0) return fail(&b);
    PyObject *held = PyTuple_New(n);
    if (held == NULL) return fail(&b);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (put_int_reserved(&b, items[i]) < 0) {
            Py_DECREF(held); /* (its items not yet set are NULL, which a tuple's dealloc skips) */
            return fail(&b);
        }
        Py_INCREF(items[i]);
        PyTuple_SET_ITEM(held, i, items[i]);
    }
    PyObject *data = finish(&b);
    if (data == NULL) {
        Py_DECREF(held);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, data, held);
    Py_DECREF(data);
    Py_DECREF(held);
    return out;
}

/* Whether two lists or tuples hold the very same objects, in order (a memcmp of their item pointers): then each item
 * is what it was, and encodes as it did. Nothing is dereferenced, so a long prompt costs ~1 us, not its encode. */
static PyObject *same_items(PyObject *self, PyObject *args) {
    PyObject *a, *b, **xa, **xb;
    Py_ssize_t na, nb;
    if (!PyArg_ParseTuple(args, "OO", &a, &b) || items_of(a, &xa, &na) < 0 || items_of(b, &xb, &nb) < 0) return NULL;
    return PyBool_FromLong(na == nb && (na == 0 || memcmp(xa, xb, (size_t)na * sizeof(PyObject *)) == 0));
}

static PyMethodDef methods[] = {
    {"int_array", int_array, METH_O, "msgpack of a list of ints, as msgspec encodes it."},
    {"handle_array", handle_array, METH_VARARGS, "msgpack of [handles[x] for x in ids] (handles may intern)."},
    {"diff_array", diff_array, METH_VARARGS, "msgpack of [x - y for x, y in zip(a, b)] (int64 only)."},
    {"token_lists", token_lists, METH_O, "(msgpack of a list of int lists, the count of their ints)."},
    {"ordered_values", ordered_values, METH_VARARGS, "msgpack of a dict's int values when its keys are a list, else None."},
    {"is_index", is_index, METH_VARARGS, "Whether a dict is {ids[i]: i}, in that order."},
    {"int_array_held", int_array_held, METH_O, "(int_array's bytes, a tuple of the items encoded)."},
    {"same_items", same_items, METH_VARARGS, "Whether two lists or tuples hold the same objects in order."},
    {"one_token_rows", one_token_rows, METH_VARARGS, "Whether msgpack bytes are [[ids[r, 0]] for rows row..row+n-1]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_wire", "Compiled column passes (see fastwire).", -1, methods};

PyMODINIT_FUNC PyInit__wire(void) { return PyModule_Create(&module); }
