/* A writer's sealed chunks compressed and written on threads that never need the GIL (`replay.capture.emitter`
 * uses them where this loads).
 *
 * Why: a Python thread needs the GIL back after each zstd call and each write, and a busy recording loop gives it up
 * only at the interpreter's switch interval (5 ms). capture_bench's loop sealed a 1 MiB chunk every 3-8 ms while
 * each took its threads 2-3 such waits besides ~3 ms of zstd: they fell behind, and close() drained the rest (a
 * third of the prefill-heavy run's wall time). These threads join a chunk's records, compress them with libzstd
 * and write the frames in order with no Python object touched: the recording thread holds a reference to each
 * part until it collects the frame's place in the file (`done`).
 *
 * libzstd is the system's (`libzstd.so.1`, loaded with dlopen: the Python package `zstandard` bundles its own but
 * exports none of it). Where it is missing the module still imports and `available()` says why; the emitter then
 * keeps its Python threads. Frames are the same kind either way: checksummed, with their content size.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* (defines _GNU_SOURCE on Linux: sync_file_range) */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

/* The libzstd API used (stable since 1.4.0), resolved at import. */
typedef void ZCCtx;
static ZCCtx *(*z_create)(void);
static size_t (*z_free)(ZCCtx *);
static size_t (*z_set)(ZCCtx *, int, int);
static size_t (*z_compress2)(ZCCtx *, void *, size_t, const void *, size_t);
static size_t (*z_bound)(size_t);
static unsigned (*z_iserror)(size_t);
static const char *(*z_errname)(size_t);
static unsigned (*z_version)(void);
enum { Z_LEVEL = 100, Z_CONTENT_SIZE = 200, Z_CHECKSUM = 201 };
static const char *missing = "not loaded";

static void load_zstd(void) {
    void *h = dlopen("libzstd.so.1", RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) {
        missing = "libzstd.so.1 not found";
        return;
    }
#define SYM(var, name)                                  \
    if ((*(void **)&var = dlsym(h, name)) == NULL) {    \
        missing = "libzstd.so.1 lacks " name;           \
        return;                                         \
    }
    SYM(z_create, "ZSTD_createCCtx")
    SYM(z_free, "ZSTD_freeCCtx")
    SYM(z_set, "ZSTD_CCtx_setParameter")
    SYM(z_compress2, "ZSTD_compress2")
    SYM(z_bound, "ZSTD_compressBound")
    SYM(z_iserror, "ZSTD_isError")
    SYM(z_errname, "ZSTD_getErrorName")
    SYM(z_version, "ZSTD_versionNumber")
#undef SYM
    if (z_version() < 10400) {
        missing = "libzstd.so.1 older than 1.4.0";
        return;
    }
    missing = NULL;
}

/* A sealed chunk: its records (each a bytes object, held by `parts`, a list nobody changes once sealed). */
typedef struct Job {
    long long seq;
    PyObject *parts;
    const char **data;
    Py_ssize_t *len;
    Py_ssize_t n, raw; /* raw: the body's size, the msgpack array head included */
    long long offset, length;
    int caught_up;
    struct Job *next;
} Job;

typedef struct Emitter Emitter;

typedef struct { /* one compressing thread's own */
    Emitter *e;
    pthread_t thread;
    char *src, *dst;
    size_t src_cap, dst_cap;
} Worker;

struct Emitter {
    PyObject_HEAD
    int fd, level, catch_up, backlog, fsync, depth, workers, drain_workers; /* threads: while recording; at stop */
    Worker *w;
    int started, stopping, joined;
    pid_t pid;        /* the process that started the threads: a forked child has none of them to join */
    pthread_mutex_t mu;
    pthread_cond_t work, turn, space;
    Job *queue;       /* handed over, not yet taken: by seq */
    Py_ssize_t waiting, queued; /* jobs in `queue`; jobs handed over and not yet written */
    long long next_take, next_write; /* seqs: the chunk a thread takes next, the frame written next */
    long long offset; /* where that frame goes */
    Job *done, **done_tail; /* written (or dropped after an error), for `done()` to hand back */
    int err;          /* errno of the first failed write or fsync; 0 */
    char zerr[128];   /* libzstd's error, if compression failed */
};

static void job_free(Job *j) {
    Py_XDECREF(j->parts);
    PyMem_RawFree(j->data);
    PyMem_RawFree(j->len);
    PyMem_RawFree(j);
}

/* Join and compress one chunk into the worker's `dst` (no lock held, no GIL). Returns its size, or 0 with `why`. */
static size_t compress_job(Worker *w, Job *j, ZCCtx *cctx, char *why, size_t why_cap) {
    if ((size_t)j->raw > w->src_cap) {
        char *p = realloc(w->src, (size_t)j->raw);
        if (p == NULL) goto oom;
        w->src = p;
        w->src_cap = (size_t)j->raw;
    }
    char *at = w->src;
    uint32_t n = (uint32_t)j->n;
    at[0] = (char)0xDD; /* msgpack array32: the count of records, known once the chunk is sealed */
    at[1] = (char)(n >> 24); at[2] = (char)(n >> 16); at[3] = (char)(n >> 8); at[4] = (char)n;
    at += 5;
    for (Py_ssize_t i = 0; i < j->n; i++) {
        memcpy(at, j->data[i], (size_t)j->len[i]);
        at += j->len[i];
    }
    size_t bound = z_bound((size_t)j->raw);
    if (bound > w->dst_cap) {
        char *p = realloc(w->dst, bound);
        if (p == NULL) goto oom;
        w->dst = p;
        w->dst_cap = bound;
    }
    size_t got = z_compress2(cctx, w->dst, w->dst_cap, w->src, (size_t)j->raw);
    if (!z_iserror(got)) return got;
    snprintf(why, why_cap, "zstd: %s", z_errname(got));
    return 0;
oom:
    snprintf(why, why_cap, "out of memory for a chunk of %zd bytes", j->raw);
    return 0;
}

/* Write one frame at the file's end; errno or 0. Without fsync, its write-back to disk starts now (Linux): the
 * fsync at close then waits for the last frames only, not for every dirty page of the run. */
static int write_frame(Emitter *e, const char *p, size_t n, long long at) {
    size_t left = n;
    while (left) {
        ssize_t w = write(e->fd, p, left);
        if (w < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        p += w;
        left -= (size_t)w;
    }
    if (e->fsync) return fsync(e->fd) < 0 ? errno : 0;
#ifdef SYNC_FILE_RANGE_WRITE
    sync_file_range(e->fd, at, (off_t)n, SYNC_FILE_RANGE_WRITE); /* (a hint: a failure here is no failure) */
#endif
    return 0;
}

static ZCCtx *make_cctx(int level) {
    ZCCtx *c = z_create();
    if (c == NULL) return NULL;
    if (z_iserror(z_set(c, Z_LEVEL, level)) || z_iserror(z_set(c, Z_CHECKSUM, 1)) ||
        z_iserror(z_set(c, Z_CONTENT_SIZE, 1))) {
        z_free(c);
        return NULL;
    }
    return c;
}

/* A worker: take the chunks in seq order, compress them (several at once, one a worker), write the frames in seq
 * order. */
static void *run(void *arg) {
    Worker *w = arg;
    Emitter *e = w->e;
    ZCCtx *cctx = make_cctx(e->level);
    ZCCtx *fast = e->catch_up < e->level ? make_cctx(e->catch_up) : NULL;
    pthread_mutex_lock(&e->mu);
    if (cctx == NULL && !e->zerr[0]) snprintf(e->zerr, sizeof e->zerr, "zstd: cannot make a compression context");
    for (;;) {
        while (!(e->queue && e->queue->seq == e->next_take) && !(e->stopping && e->queue == NULL))
            pthread_cond_wait(&e->work, &e->mu);
        if (e->queue == NULL) break; /* stopping, and every chunk handed over is taken */
        Job *j = e->queue;
        e->queue = j->next;
        j->next = NULL;
        e->next_take++;
        e->waiting--;
        /* catching up, as `zstd --adapt` does: the recorder is this many chunks ahead */
        j->caught_up = fast != NULL && e->waiting >= e->backlog;
        int failed = e->err || e->zerr[0];
        if (e->queue && e->queue->seq == e->next_take) pthread_cond_signal(&e->work); /* (for another worker) */
        pthread_mutex_unlock(&e->mu);
        char why[sizeof e->zerr] = "";
        size_t got = failed ? 0 : compress_job(w, j, j->caught_up ? fast : cctx, why, sizeof why);
        pthread_mutex_lock(&e->mu);
        while (e->next_write != j->seq) pthread_cond_wait(&e->turn, &e->mu);
        if (got == 0 && !failed && !e->zerr[0]) memcpy(e->zerr, why, sizeof why);
        long long at = e->offset;
        int ok = got > 0 && !e->err && !e->zerr[0];
        pthread_mutex_unlock(&e->mu);
        int bad = ok ? write_frame(e, w->dst, got, at) : 0; /* (its turn: no other worker writes meanwhile) */
        pthread_mutex_lock(&e->mu);
        if (bad && !e->err) e->err = bad;
        if (ok && !bad) {
            j->offset = at;
            j->length = (long long)got;
            e->offset += (long long)got;
        } else {
            j->length = -1; /* (not written: kept draining, so producers never wait on it) */
        }
        e->next_write++;
        e->queued--;
        *e->done_tail = j;
        e->done_tail = &j->next;
        pthread_cond_broadcast(&e->turn);
        pthread_cond_broadcast(&e->space);
    }
    pthread_mutex_unlock(&e->mu);
    if (cctx) z_free(cctx);
    if (fast) z_free(fast);
    return NULL;
}

static int Emitter_init(Emitter *e, PyObject *args, PyObject *kw) {
    static char *names[] = {"fd", "level", "catch_up_level", "backlog", "fsync", "depth", "offset", "first",
                            "workers", "drain_workers", NULL};
    long long offset = 0, first = 0;
    e->catch_up = 1 << 30;
    e->workers = 1;
    e->drain_workers = 0;
    if (e->done_tail != NULL) {
        PyErr_SetString(PyExc_ValueError, "an Emitter is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "ii|iipiLLii", names, &e->fd, &e->level, &e->catch_up, &e->backlog,
                                     &e->fsync, &e->depth, &offset, &first, &e->workers, &e->drain_workers))
        return -1;
    if (missing != NULL) {
        PyErr_Format(PyExc_ImportError, "compiled emitter unavailable: %s", missing);
        return -1;
    }
    if (e->depth < 1) e->depth = 1;
    if (e->drain_workers < e->workers) e->drain_workers = e->workers;
    if (e->workers < 1 || e->drain_workers > 64) {
        PyErr_SetString(PyExc_ValueError, "workers must be 1-64");
        return -1;
    }
    e->w = PyMem_RawCalloc((size_t)e->drain_workers, sizeof(Worker));
    if (e->w == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < e->drain_workers; i++) e->w[i].e = e;
    e->offset = offset;
    e->next_take = e->next_write = first;
    e->done_tail = &e->done;
    pthread_mutex_init(&e->mu, NULL);
    pthread_cond_init(&e->work, NULL);
    pthread_cond_init(&e->turn, NULL);
    pthread_cond_init(&e->space, NULL);
    return 0;
}

static PyObject *Emitter_start(Emitter *e, PyObject *unused) {
    if (e->started || e->done_tail == NULL) Py_RETURN_NONE;
    for (int i = 0; i < e->workers; i++) {
        int bad = pthread_create(&e->w[i].thread, NULL, run, &e->w[i]);
        if (bad) {
            e->workers = i; /* (those started are joined at stop) */
            e->started = i > 0;
            e->pid = getpid();
            errno = bad;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    e->started = 1;
    e->pid = getpid();
    Py_RETURN_NONE;
}

/* submit(seq, parts, block=True): hand over sealed chunk `seq` (a list of bytes). With `block`, waits (GIL
 * released) while `depth` chunks wait, unless it is the very chunk the thread waits for. */
static PyObject *Emitter_submit(Emitter *e, PyObject *args) {
    long long seq;
    PyObject *parts;
    int block = 1;
    if (!PyArg_ParseTuple(args, "LO!|p", &seq, &PyList_Type, &parts, &block)) return NULL;
    if (e->stopping) {
        PyErr_SetString(PyExc_ValueError, "emitter stopped");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(parts);
    Job *j = PyMem_RawCalloc(1, sizeof(Job));
    if (j == NULL) return PyErr_NoMemory();
    j->data = PyMem_RawMalloc(sizeof(char *) * (size_t)(n ? n : 1));
    j->len = PyMem_RawMalloc(sizeof(Py_ssize_t) * (size_t)(n ? n : 1));
    if (j->data == NULL || j->len == NULL) {
        job_free(j);
        return PyErr_NoMemory();
    }
    j->raw = 5;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PyList_GET_ITEM(parts, i);
        if (!PyBytes_Check(p)) {
            job_free(j);
            PyErr_SetString(PyExc_TypeError, "a chunk's parts must be bytes");
            return NULL;
        }
        j->data[i] = PyBytes_AS_STRING(p);
        j->len[i] = PyBytes_GET_SIZE(p);
        j->raw += j->len[i];
    }
    if (n > UINT32_MAX) {
        job_free(j);
        PyErr_SetString(PyExc_OverflowError, "too many records in a chunk");
        return NULL;
    }
    Py_INCREF(parts);
    j->parts = parts;
    j->n = n;
    j->seq = seq;
    /* (mu is never held while the GIL is awaited: the thread never takes the GIL, and a waiting producer lets go
     * of mu before it takes the GIL back) */
    pthread_mutex_lock(&e->mu);
    if (block && e->started && e->queued >= e->depth && seq != e->next_take && !e->stopping) {
        pthread_mutex_unlock(&e->mu);
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&e->mu);
        while (e->queued >= e->depth && seq != e->next_take && !e->stopping) pthread_cond_wait(&e->space, &e->mu);
        pthread_mutex_unlock(&e->mu);
        Py_END_ALLOW_THREADS
        pthread_mutex_lock(&e->mu);
    }
    Job **at = &e->queue;
    while (*at && (*at)->seq < seq) at = &(*at)->next;
    j->next = *at;
    *at = j;
    e->queued++;
    e->waiting++;
    pthread_cond_signal(&e->work);
    pthread_mutex_unlock(&e->mu);
    Py_RETURN_NONE;
}

/* done(): [(seq, offset, length, raw_size, caught_up)] of the frames written since the last call, in file order
 * (length -1: dropped after an error), each chunk's records let go. */
static PyObject *Emitter_done(Emitter *e, PyObject *unused) {
    pthread_mutex_lock(&e->mu);
    Job *j = e->done;
    e->done = NULL;
    e->done_tail = &e->done;
    pthread_mutex_unlock(&e->mu);
    PyObject *out = PyList_New(0);
    while (j) {
        Job *next = j->next;
        PyObject *t = out ? Py_BuildValue("(LLLnO)", j->seq, j->offset, j->length, j->raw,
                                          j->caught_up ? Py_True : Py_False) : NULL;
        if (t == NULL || PyList_Append(out, t) < 0) Py_CLEAR(out);
        Py_XDECREF(t);
        job_free(j);
        j = next;
    }
    return out;
}

static void join(Emitter *e) {
    pthread_mutex_lock(&e->mu);
    e->stopping = 1;
    int more = e->started && !e->joined && e->pid == getpid() && e->waiting >= 2;
    pthread_cond_broadcast(&e->work);
    pthread_cond_broadcast(&e->space);
    pthread_mutex_unlock(&e->mu);
    /* the recorder is done: the cores it had drain what waits (close() waits on it) */
    while (more && e->workers < e->drain_workers &&
           pthread_create(&e->w[e->workers].thread, NULL, run, &e->w[e->workers]) == 0)
        e->workers++;
    if (e->started && !e->joined && e->pid == getpid()) {
        for (int i = 0; i < e->workers; i++) pthread_join(e->w[i].thread, NULL);
        e->joined = 1;
    }
}

/* stop(): write every chunk handed over, then end the thread (GIL released while it drains). */
static PyObject *Emitter_stop(Emitter *e, PyObject *unused) {
    if (!e->started) {
        PyErr_SetString(PyExc_ValueError, "emitter not started");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    join(e);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Emitter_error(Emitter *e, void *closure) {
    pthread_mutex_lock(&e->mu);
    int err = e->err;
    char zerr[sizeof e->zerr];
    memcpy(zerr, e->zerr, sizeof zerr);
    pthread_mutex_unlock(&e->mu);
    if (err) return Py_BuildValue("(is)", err, strerror(err));
    if (zerr[0]) return Py_BuildValue("(is)", 0, zerr);
    Py_RETURN_NONE;
}

static PyObject *Emitter_queued(Emitter *e, void *closure) {
    pthread_mutex_lock(&e->mu);
    Py_ssize_t q = e->queued;
    pthread_mutex_unlock(&e->mu);
    return PyLong_FromSsize_t(q);
}

static void Emitter_dealloc(Emitter *e) {
    /* (initialised, and not a forked child's copy: its threads, and a lock one of them held, stayed behind) */
    if (e->done_tail != NULL && (!e->started || e->pid == getpid())) {
        Py_BEGIN_ALLOW_THREADS
        join(e);
        Py_END_ALLOW_THREADS
        for (Job *j = e->done, *next; j; j = next) {
            next = j->next;
            job_free(j);
        }
        for (Job *j = e->queue, *next; j; j = next) { /* (never started: nothing took them) */
            next = j->next;
            job_free(j);
        }
        pthread_mutex_destroy(&e->mu);
        pthread_cond_destroy(&e->work);
        pthread_cond_destroy(&e->turn);
        pthread_cond_destroy(&e->space);
        for (int i = 0; i < e->drain_workers; i++) {
            free(e->w[i].src);
            free(e->w[i].dst);
        }
        PyMem_RawFree(e->w);
    }
    Py_TYPE(e)->tp_free((PyObject *)e);
}

static PyMethodDef Emitter_methods[] = {
    {"start", (PyCFunction)Emitter_start, METH_NOARGS, "Start the thread."},
    {"submit", (PyCFunction)Emitter_submit, METH_VARARGS, "submit(seq, parts, block=True): hand a sealed chunk over."},
    {"done", (PyCFunction)Emitter_done, METH_NOARGS, "[(seq, offset, length, raw_size, caught_up)] written since."},
    {"stop", (PyCFunction)Emitter_stop, METH_NOARGS, "Write every chunk handed over, then end the thread."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Emitter_getset[] = {
    {"error", (getter)Emitter_error, NULL, "(errno, message) of the first failure (errno 0: zstd's), or None.", NULL},
    {"queued", (getter)Emitter_queued, NULL, "Chunks handed over and not yet written.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject EmitterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "replay.capture._emit.Emitter",
    .tp_basicsize = sizeof(Emitter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Emitter(fd, level, catch_up_level=none, backlog=0, fsync=False, depth=1, offset=0, first=0, workers=1, "
              "drain_workers=workers): threads that compress chunks and write their frames to fd, in seq order from "
              "`first`, at `offset` (`drain_workers` of them once stopping, with two chunks or more waiting).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Emitter_init,
    .tp_dealloc = (destructor)Emitter_dealloc,
    .tp_methods = Emitter_methods,
    .tp_getset = Emitter_getset,
};

static PyObject *available(PyObject *self, PyObject *unused) {
    if (missing != NULL) return PyUnicode_FromString(missing);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"available", available, METH_NOARGS, "None where libzstd loaded; else why not."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_emit", "Compress and write chunks off the GIL.", -1,
                                    methods};

PyMODINIT_FUNC PyInit__emit(void) {
    load_zstd();
    if (PyType_Ready(&EmitterType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&EmitterType);
    if (PyModule_AddObject(m, "Emitter", (PyObject *)&EmitterType) < 0) {
        Py_DECREF(&EmitterType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
