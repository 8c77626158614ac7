/* kvtier._readloop: a directory tier's O_DIRECT load, run in one native call
 * without the GIL (kvtier/tiers/dir/nativestream.py drives it; docs/architecture.md).
 *
 * Why native: in Python a verified cold read cost about twice fio's CPU per
 * GB, most of it neither the kernel's nor the checksum's but the interpreter's
 * per-object steps and the hand-offs between a load's driver, its
 * verification jobs and its consumer (GIL waits and wake-ups; measured in
 * docs/benchmarks.md). Here one thread opens each object beneath the store's
 * folder (openat2, no symlink followed), checks its size, submits its read
 * (Linux native AIO), reaps, and checks the payload's XXH3-128 against the
 * header, all without the GIL; the consumer waits for one object at a time,
 * without the GIL too.
 *
 * What it decides is narrow on purpose: an object either read whole and its
 * payload's checksum matched the header's (OK), or anything else (FALLBACK:
 * not there, refused, another size, a failed read, a checksum that does not
 * match). The Python side reads a FALLBACK object again the ordinary way,
 * which tells a miss, a corrupt object (quarantined) and an error apart
 * exactly as every other read does.
 *
 * The header is never parsed here: codec.py is the format's one owner. Where
 * the caller passed the header bytes it expects before the payload checksum
 * (``expect``: built by codec.expected_head from the key and the layout the
 * tier learned), an OK object whose bytes equal them and whose header CRC-32
 * matches is marked ``exact`` (the consumer then builds its header without
 * parsing); any other OK object's header is parsed and checked by
 * codec.decode, as before.
 *
 * An OK object's file is closed here, not by the consumer, where the caller
 * said it owes no recency stamp through it (``close_fresh``: its mtime is
 * that recent): a close on the consumer's thread cost 3-4 us of its CPU per
 * object in a load through the store, against well under one here, where
 * the file was just used (docs/benchmarks.md).
 *
 * Threads: ``run`` on one thread (a tier pool job); ``wait``, ``give`` and
 * ``stop`` from any other, under the load's mutex.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

struct kvt_open_how { uint64_t flags, mode, resolve; };
#define KVT_RESOLVE_NO_SYMLINKS 0x04
#define KVT_RESOLVE_BENEATH 0x08

#define HEADER_BLOCK 4096
#define HEADER_STRUCT_SIZE 256 /* codec.HEADER_STRUCT_SIZE; nativestream checks the three at import */
#define ALIGN 4096
#define MAX_PAYLOAD (1ULL << 32)
#define MAX_PIECES 64
#define HEAD_EXPECTED 196 /* the header's bytes before the payload checksum (codec.CHECKSUM_AT) */
#define HEAD_CRC_AT 252   /* the header CRC-32, of the bytes before it (codec.CRC_AT) */

typedef struct { uint64_t low64, high64; } xxh128_t;
typedef xxh128_t (*xxh3_128_fn)(const void *, size_t);
static xxh3_128_fn xxh3_128 = NULL;
static uint32_t crc_table[256]; /* CRC-32 (IEEE, reflected: zlib's), filled at import */

enum { PENDING = 0, OK = 1, FALLBACK = 2, SKIPPED = 3 };

typedef struct {
    char *path;           /* relative to the base folder */
    unsigned char *buf;   /* NULL until ``give`` */
    unsigned char *expect; /* the header's first HEAD_EXPECTED bytes as expected, or NULL */
    int exact;            /* OK, and the header is ``expect`` with a matching CRC-32 */
    size_t cap;           /* the buffer's length: the object's, exactly */
    uint64_t est;         /* bytes, for the window */
    int state, err, fd;
    int pieces, left, failed, short_at;
    int64_t res[MAX_PIECES];
    double mtime, opened_s, t0;
    size_t size, piece;
} item_t;

typedef struct {
    PyObject_HEAD
    int base_fd, n, depth, min_inflight, refused, broken;
    item_t *items;
    aio_context_t ctx;
    uint64_t window, piece;
    double taper, poll_s;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int limit, started, finished, waiters;
    double opening_s, active_s;
    int trace;            /* record when reads went to the kernel and landed */
    double close_fresh;   /* OK objects of an mtime at least this: their files closed by the loop (NaN: none) */
    int nev, capev;
    double *ev_t;
    int *ev_d;
} Load;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void deadline_ts(struct timespec *ts, double timeout_s) {
    clock_gettime(CLOCK_REALTIME, ts);
    double sec = (double)ts->tv_sec + ts->tv_nsec * 1e-9 + timeout_s;
    ts->tv_sec = (time_t)sec;
    ts->tv_nsec = (long)((sec - (double)ts->tv_sec) * 1e9);
}

/* A benchmark's trace: ``delta`` pieces went to the kernel (> 0) or landed. */
static void record(Load *ld, int delta) {
    if (!ld->trace || delta == 0)
        return;
    if (ld->nev == ld->capev) {
        int cap = ld->capev ? 2 * ld->capev : 256;
        double *t = realloc(ld->ev_t, (size_t)cap * sizeof(double));
        if (t)
            ld->ev_t = t;
        int *d = realloc(ld->ev_d, (size_t)cap * sizeof(int));
        if (d)
            ld->ev_d = d;
        if (!t || !d)
            return;
        ld->capev = cap;
    }
    ld->ev_t[ld->nev] = now_s();
    ld->ev_d[ld->nev++] = delta;
}

/* Publish item i's state; wake the consumer if it waits. */
static void publish(Load *ld, int i, int state, int err) {
    ld->items[i].err = err;
    __atomic_store_n(&ld->items[i].state, state, __ATOMIC_SEQ_CST);
    /* A waiter counts itself under the mutex, then looks at the state: it
     * sees this one, or it is counted here and woken (under the mutex, so
     * not before it waits). Nobody waiting: no lock, no system call. */
    if (__atomic_load_n(&ld->waiters, __ATOMIC_SEQ_CST)) {
        pthread_mutex_lock(&ld->mu);
        pthread_cond_broadcast(&ld->cv);
        pthread_mutex_unlock(&ld->mu);
    }
}

/* Whether ``n`` bytes at ``p`` are all zero. */
static int all_zero(const unsigned char *p, size_t n) {
    return n == 0 || (p[0] == 0 && memcmp(p, p + 1, n - 1) == 0);
}

/* Whether the object read into item ``it`` (``got`` bytes) has zero padding
 * (after the header struct, and after the payload up to the object's
 * end) and a payload whose XXH3-128 is the header's: the bytes no header
 * field describes (docs/format.md; offsets as in kvtier/codec.py). */
static int payload_ok(const item_t *it, size_t got) {
    const unsigned char *b = it->buf;
    if (got < HEADER_BLOCK || memcmp(b, "KVTCHUNK", 8) != 0)
        return 0;
    uint64_t plen;
    memcpy(&plen, b + 188, 8); /* little endian, as the format (x86-64, arm64) */
    if (plen == 0 || plen > MAX_PAYLOAD || HEADER_BLOCK + plen > got || HEADER_BLOCK + plen > it->cap)
        return 0;
    uint64_t end = HEADER_BLOCK + (plen + ALIGN - 1) / ALIGN * ALIGN; /* the object's length */
    if (end > got || !all_zero(b + HEADER_STRUCT_SIZE, HEADER_BLOCK - HEADER_STRUCT_SIZE) ||
        !all_zero(b + HEADER_BLOCK + plen, (size_t)(end - HEADER_BLOCK - plen)))
        return 0;
    xxh128_t h = xxh3_128(b + HEADER_BLOCK, (size_t)plen);
    unsigned char d[16];
    for (int k = 0; k < 8; k++) {
        d[k] = (unsigned char)(h.high64 >> (56 - 8 * k));
        d[8 + k] = (unsigned char)(h.low64 >> (56 - 8 * k));
    }
    return memcmp(d, b + 196, 16) == 0;
}

static uint32_t crc32_ieee(const unsigned char *p, size_t n) {
    uint32_t c = 0xffffffffu;
    while (n--)
        c = crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

/* Whether the header of the object in ``it`` is the one expected, byte for
 * byte, with a CRC-32 that matches it (nothing more is parsed here). */
static int header_exact(const item_t *it) {
    const unsigned char *b = it->buf;
    uint32_t crc;
    if (it->expect == NULL || memcmp(b, it->expect, HEAD_EXPECTED) != 0)
        return 0;
    memcpy(&crc, b + HEAD_CRC_AT, 4); /* little endian, as the format */
    return crc32_ieee(b, HEAD_CRC_AT) == crc;
}

/* Open item i beneath the base folder with O_DIRECT; 0, or an errno. */
static int open_item(Load *ld, item_t *it) {
    double t0 = now_s();
    it->t0 = t0;
    struct kvt_open_how how = {O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_DIRECT | O_CLOEXEC, 0,
                               KVT_RESOLVE_BENEATH | KVT_RESOLVE_NO_SYMLINKS};
    long fd;
    do {
        fd = syscall(SYS_openat2, ld->base_fd, it->path, &how, sizeof how);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0)
        return errno;
    struct stat st;
    int bad = 0;
    if (fstat((int)fd, &st) != 0)
        bad = errno;
    else if (!S_ISREG(st.st_mode) || (size_t)st.st_size != it->cap)
        bad = EBADMSG; /* not a file, or not of the size expected: the ordinary read judges it */
    if (bad) {
        close((int)fd);
        return bad;
    }
    it->fd = (int)fd;
    it->size = (size_t)st.st_size;
    it->mtime = (double)st.st_mtim.tv_sec + st.st_mtim.tv_nsec * 1e-9;
    it->opened_s = now_s() - t0;
    ld->opening_s += it->opened_s;
    return 0;
}

/* The driver's own state (one thread: no lock). */
typedef struct {
    struct iocb *cbs;
    struct io_event *evs;
    struct iocb **batch;
    int *free_slots, *landed;
    int nfree, inflight, objs, next, nlanded, broken;
    uint64_t inflight_bytes, left_bytes;
} drv_t;

/* An object all of whose pieces landed: failed (FALLBACK, or SKIPPED past
 * the consumer's stop), or queued for its check. */
static void landed(Load *ld, drv_t *st, int i) {
    item_t *it = &ld->items[i];
    st->objs--;
    st->inflight_bytes -= it->est;
    st->left_bytes -= it->est;
    if (i >= __atomic_load_n(&ld->limit, __ATOMIC_ACQUIRE)) {
        publish(ld, i, SKIPPED, 0);
        return;
    }
    if (it->failed) {
        if (it->failed == EINVAL)
            ld->refused = 1;
        publish(ld, i, FALLBACK, it->failed);
        return;
    }
    size_t whole = 0; /* bytes from the start without a gap (a short piece ends the file) */
    for (int k = 0; k < it->pieces; k++) {
        whole += (size_t)it->res[k];
        size_t off = (size_t)k * it->piece, want = it->cap - off < it->piece ? it->cap - off : it->piece;
        if ((size_t)it->res[k] < want)
            break;
    }
    it->size = whole;
    st->landed[st->nlanded++] = i;
}

/* Reap completions: wait up to ``timeout_s`` for at least ``min_nr``. */
static void reap(Load *ld, drv_t *st, long min_nr, double timeout_s) {
    struct timespec wait = {(time_t)timeout_s, (long)((timeout_s - (double)(time_t)timeout_s) * 1e9)};
    long got;
    do {
        got = syscall(SYS_io_getevents, ld->ctx, min_nr, (long)ld->depth, st->evs, &wait);
    } while (got < 0 && errno == EINTR);
    if (got < 0) {
        /* Cannot reap (cannot happen with a live context): submit nothing
         * more; the drain waits for what is in flight. */
        st->broken = 1;
        return;
    }
    record(ld, -(int)got);
    for (long e = 0; e < got; e++) {
        int i = (int)(st->evs[e].data >> 16), s = (int)(st->evs[e].data & 0xffff);
        item_t *it = &ld->items[i];
        int k = (int)(st->cbs[s].aio_offset / (int64_t)it->piece);
        st->free_slots[st->nfree++] = s;
        st->inflight--;
        it->res[k] = st->evs[e].res;
        if (st->evs[e].res < 0)
            it->failed = (int)-st->evs[e].res;
        if (--it->left == 0)
            landed(ld, st, i);
    }
}

/* Open object ``st->next`` and submit its reads; 0 if the window or the
 * kernel's queue has no room for it now (nothing done). */
static int start_next(Load *ld, drv_t *st) {
    item_t *it = &ld->items[st->next];
    uint64_t cap = (uint64_t)(ld->taper * (double)st->left_bytes);
    if (cap > ld->window)
        cap = ld->window;
    if (!(st->objs < ld->min_inflight || st->inflight_bytes + it->est <= cap))
        return 0;
    int pieces = (int)((it->cap + ld->piece - 1) / ld->piece);
    if (pieces > MAX_PIECES)
        pieces = MAX_PIECES;
    if (pieces > st->nfree)
        return 0;
    int err = open_item(ld, it);
    if (err) {
        st->left_bytes -= it->est;
        if (err == ENOENT) {
            /* A miss: the load ends there (its ordinary read will say so),
             * so nothing past it is read, as the Python driver does. */
            pthread_mutex_lock(&ld->mu);
            if (st->next + 1 < ld->limit)
                __atomic_store_n(&ld->limit, st->next + 1, __ATOMIC_RELEASE);
            pthread_mutex_unlock(&ld->mu);
        }
        publish(ld, st->next++, FALLBACK, err);
        return 1;
    }
    size_t piece = ((it->cap + pieces - 1) / pieces + ALIGN - 1) / ALIGN * ALIGN;
    int nb = 0;
    it->piece = piece;
    it->pieces = 0;
    it->failed = 0;
    for (size_t off = 0; off < it->cap; off += piece) {
        int s = st->free_slots[--st->nfree];
        struct iocb *cb = &st->cbs[s];
        memset(cb, 0, sizeof *cb);
        cb->aio_data = ((uint64_t)st->next << 16) | (uint64_t)s;
        cb->aio_lio_opcode = IOCB_CMD_PREAD;
        cb->aio_fildes = (uint32_t)it->fd;
        cb->aio_buf = (uint64_t)(uintptr_t)(it->buf + off);
        cb->aio_nbytes = it->cap - off < piece ? it->cap - off : piece;
        cb->aio_offset = (int64_t)off;
        it->res[it->pieces++] = 0;
        st->batch[nb++] = cb;
    }
    it->left = nb;
    int took = 0;
    while (took < nb) {
        long r = syscall(SYS_io_submit, ld->ctx, (long)(nb - took), st->batch + took);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0 && errno == EAGAIN && st->inflight + took > 0) {
            /* The kernel is short of requests: let one land first. */
            if (st->inflight > 0)
                reap(ld, st, 1, ld->poll_s);
            else {
                struct timespec ts = {0, 1000000};
                nanosleep(&ts, NULL);
            }
            continue;
        }
        if (r <= 0) {
            int e = r < 0 ? errno : EAGAIN;
            for (int k = took; k < nb; k++) /* never in flight: their slots back */
                st->free_slots[st->nfree++] = (int)(st->batch[k]->aio_data & 0xffff);
            if (e == EINVAL)
                ld->refused = 1;
            if (took == 0) {
                st->left_bytes -= it->est;
                publish(ld, st->next++, FALLBACK, e);
                return 1;
            }
            it->left -= nb - took; /* what is in flight lands; the object failed */
            it->failed = e;
            break;
        }
        record(ld, (int)r);
        st->inflight += (int)r;
        took += (int)r;
    }
    st->objs++;
    st->inflight_bytes += it->est;
    st->next++;
    return 1;
}

/* The driver: everything between the first open and the last read landed.
 * Landed objects are checked one at a time, the consumer's next first, and
 * between two checks the window is refilled: the device is not left idle
 * while the loop checks what it read. */
static void drive(Load *ld) {
    drv_t st = {0};
    double t_first = now_s();
    st.cbs = calloc((size_t)ld->depth, sizeof(struct iocb));
    st.evs = calloc((size_t)ld->depth, sizeof(struct io_event));
    st.batch = calloc((size_t)ld->depth, sizeof(struct iocb *));
    st.free_slots = calloc((size_t)ld->depth, sizeof(int));
    st.landed = calloc(ld->n ? (size_t)ld->n : 1, sizeof(int));
    if (ld->base_fd < 0)
        goto out; /* the folder would not open: every object SKIPPED */
    if (!st.cbs || !st.evs || !st.batch || !st.free_slots || !st.landed) {
        for (int i = 0; i < ld->n; i++)
            publish(ld, i, FALLBACK, ENOMEM);
        goto out;
    }
    st.nfree = ld->depth;
    for (int s = 0; s < ld->depth; s++)
        st.free_slots[s] = s;
    for (int i = 0; i < ld->n; i++)
        st.left_bytes += ld->items[i].est;
    while (!st.broken) {
        int want_buffer = 0;
        /* The limit is read again before each open: a miss (start_next) or
         * the consumer's stop lowers it. */
        while (st.next < __atomic_load_n(&ld->limit, __ATOMIC_ACQUIRE) && !st.broken) {
            if (__atomic_load_n(&ld->items[st.next].buf, __ATOMIC_ACQUIRE) == NULL) {
                want_buffer = 1;
                break;
            }
            if (!start_next(ld, &st))
                break;
        }
        if (st.nlanded > 0) {
            /* Check one landed object, the consumer's next first; then look
             * (without waiting) for more that landed, and refill. */
            int k = 0;
            for (int j = 1; j < st.nlanded; j++)
                if (st.landed[j] < st.landed[k])
                    k = j;
            int i = st.landed[k];
            st.landed[k] = st.landed[--st.nlanded];
            item_t *it = &ld->items[i];
            if (i >= __atomic_load_n(&ld->limit, __ATOMIC_ACQUIRE))
                publish(ld, i, SKIPPED, 0);
            else if (payload_ok(it, it->size)) {
                it->exact = header_exact(it);
                if (it->mtime >= ld->close_fresh) { /* NaN: never */
                    /* Its file owes no recency stamp: closed here, before
                     * the consumer may look at its descriptor. */
                    close(it->fd);
                    it->fd = -1;
                }
                publish(ld, i, OK, 0);
            } else
                publish(ld, i, FALLBACK, EBADMSG);
            if (st.inflight > 0)
                reap(ld, &st, 0, 0.0);
            continue;
        }
        if (st.inflight == 0) {
            if (st.next >= __atomic_load_n(&ld->limit, __ATOMIC_ACQUIRE))
                break;
            if (want_buffer) {
                /* Nothing in flight and no buffer for the next object yet:
                 * wait for the consumer's ``give`` (or ``stop``). */
                struct timespec ts;
                deadline_ts(&ts, ld->poll_s);
                pthread_mutex_lock(&ld->mu);
                if (ld->items[st.next].buf == NULL && st.next < ld->limit)
                    pthread_cond_timedwait(&ld->cv, &ld->mu, &ts);
                pthread_mutex_unlock(&ld->mu);
            }
            continue;
        }
        reap(ld, &st, 1, ld->poll_s);
    }
    /* Drain: no buffer is written to once ``run`` returned. */
    while (st.inflight > 0) {
        long got = syscall(SYS_io_getevents, ld->ctx, 1L, (long)ld->depth, st.evs, NULL);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            break; /* cannot happen with a live context; nothing else to do */
        }
        record(ld, -(int)got);
        st.inflight -= (int)got;
    }
out:
    pthread_mutex_lock(&ld->mu);
    ld->broken = st.broken;
    for (int i = 0; i < ld->n; i++)
        if (ld->items[i].state == PENDING)
            __atomic_store_n(&ld->items[i].state, SKIPPED, __ATOMIC_SEQ_CST);
    ld->finished = 1;
    ld->active_s = now_s() - t_first;
    pthread_cond_broadcast(&ld->cv);
    pthread_mutex_unlock(&ld->mu);
    free(st.cbs);
    free(st.evs);
    free(st.batch);
    free(st.free_slots);
    free(st.landed);
}

/* ------------------------------------------------------------ Python type */

static void Load_dealloc(Load *ld) {
    if (ld->items) {
        for (int i = 0; i < ld->n; i++) {
            free(ld->items[i].path);
            free(ld->items[i].expect);
        }
        free(ld->items);
    }
    free(ld->ev_t);
    free(ld->ev_d);
    pthread_mutex_destroy(&ld->mu);
    pthread_cond_destroy(&ld->cv);
    Py_TYPE(ld)->tp_free((PyObject *)ld);
}

static int Load_init(Load *ld, PyObject *args, PyObject *kw) {
    static char *names[] = {"paths", "sizes", "ctx", "depth", "window", "taper",
                            "min_inflight", "piece", "poll_s", "trace", "expect", "close_fresh", NULL};
    PyObject *paths, *sizes, *expect = Py_None;
    ld->close_fresh = NAN;
    unsigned long long ctx, window, piece;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOKiKdiKd|pOd", names, &paths, &sizes, &ctx, &ld->depth, &window,
                                     &ld->taper, &ld->min_inflight, &piece, &ld->poll_s, &ld->trace, &expect,
                                     &ld->close_fresh))
        return -1;
    if (xxh3_128 == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "kvtier._readloop: set_hash() was not called");
        return -1;
    }
    if (ld->depth < MAX_PIECES || ld->depth > 65535 || piece < ALIGN || piece % ALIGN) {
        PyErr_SetString(PyExc_ValueError, "depth must be 64-65535, piece a multiple of 4096");
        return -1;
    }
    Py_ssize_t n = PySequence_Size(paths);
    if (n < 0 || PySequence_Size(sizes) != n || (expect != Py_None && PySequence_Size(expect) != n)) {
        PyErr_SetString(PyExc_ValueError, "paths, sizes and expect: sequences of one length");
        return -1;
    }
    ld->ctx = (aio_context_t)ctx;
    ld->window = window;
    ld->piece = piece;
    ld->n = (int)n;
    ld->limit = (int)n;
    ld->items = calloc(n ? (size_t)n : 1, sizeof(item_t));
    if (!ld->items) {
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&ld->mu, NULL);
    pthread_cond_init(&ld->cv, NULL);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *p = PySequence_GetItem(paths, i), *s = PySequence_GetItem(sizes, i);
        const char *c = p ? PyBytes_AsString(p) : NULL;
        unsigned long long size = s ? PyLong_AsUnsignedLongLong(s) : 0;
        Py_XDECREF(p);
        Py_XDECREF(s);
        if (c == NULL || PyErr_Occurred())
            return -1;
        if (size == 0 || size % ALIGN) {
            PyErr_SetString(PyExc_ValueError, "object sizes: positive multiples of 4096");
            return -1;
        }
        ld->items[i].path = strdup(c);
        ld->items[i].cap = (size_t)size;
        ld->items[i].est = size;
        ld->items[i].fd = -1;
        if (!ld->items[i].path) {
            PyErr_NoMemory();
            return -1;
        }
        if (expect == Py_None)
            continue;
        PyObject *e = PySequence_GetItem(expect, i);
        if (e == NULL)
            return -1;
        if (e != Py_None) {
            if (!PyBytes_Check(e) || PyBytes_GET_SIZE(e) != HEAD_EXPECTED) {
                Py_DECREF(e);
                PyErr_SetString(PyExc_ValueError, "expect: for each object, None or 196 bytes");
                return -1;
            }
            ld->items[i].expect = malloc(HEAD_EXPECTED);
            if (ld->items[i].expect)
                memcpy(ld->items[i].expect, PyBytes_AS_STRING(e), HEAD_EXPECTED);
        }
        Py_DECREF(e);
        if (e != Py_None && !ld->items[i].expect) {
            PyErr_NoMemory();
            return -1;
        }
    }
    return 0;
}

static int check_index(Load *ld, int i) {
    if (i < 0 || i >= ld->n) {
        PyErr_SetString(PyExc_IndexError, "object index out of range");
        return -1;
    }
    return 0;
}

/* give(i, buffers): objects i, i+1, ... their buffers (writable, each at
 * least its object's length; kept alive by the caller until ``run``
 * returned), in one call and under one lock. */
static PyObject *Load_give(Load *ld, PyObject *args) {
    int i;
    PyObject *bufs;
    if (!PyArg_ParseTuple(args, "iO", &i, &bufs))
        return NULL;
    PyObject *seq = PySequence_Fast(bufs, "give: a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > 0 && (check_index(ld, i) || check_index(ld, i + (int)n - 1))) {
        Py_DECREF(seq);
        return NULL;
    }
    unsigned char **ptrs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(*ptrs));
    if (ptrs == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_buffer view;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, k), &view, PyBUF_WRITABLE) < 0)
            goto fail;
        ptrs[k] = view.buf;
        int short_ = (size_t)view.len < ld->items[i + k].cap;
        PyBuffer_Release(&view);
        if (short_) {
            PyErr_SetString(PyExc_ValueError, "a buffer shorter than its object");
            goto fail;
        }
    }
    pthread_mutex_lock(&ld->mu);
    int fresh = 1;
    for (Py_ssize_t k = 0; k < n; k++)
        fresh &= ld->items[i + k].buf == NULL;
    if (fresh)
        for (Py_ssize_t k = 0; k < n; k++)
            __atomic_store_n(&ld->items[i + k].buf, ptrs[k], __ATOMIC_RELEASE);
    pthread_cond_broadcast(&ld->cv);
    pthread_mutex_unlock(&ld->mu);
    PyMem_Free(ptrs);
    Py_DECREF(seq);
    if (!fresh) {
        PyErr_SetString(PyExc_ValueError, "an object already has a buffer");
        return NULL;
    }
    Py_RETURN_NONE;
fail:
    PyMem_Free(ptrs);
    Py_DECREF(seq);
    return NULL;
}

static PyObject *Load_run(Load *ld, PyObject *args) {
    if (!PyArg_ParseTuple(args, "i", &ld->base_fd))
        return NULL;
    pthread_mutex_lock(&ld->mu);
    int again = ld->started;
    ld->started = 1;
    pthread_mutex_unlock(&ld->mu);
    if (again) {
        PyErr_SetString(PyExc_RuntimeError, "a load runs once");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    drive(ld);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* Wait until object i is no longer pending, or the timeout (seconds; None:
 * no limit): its state, PENDING on a timeout. */
static PyObject *Load_wait(Load *ld, PyObject *args) {
    int i;
    PyObject *timeout;
    if (!PyArg_ParseTuple(args, "iO", &i, &timeout) || check_index(ld, i))
        return NULL;
    double t = -1.0;
    if (timeout != Py_None) {
        t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred())
            return NULL;
        if (t < 0)
            t = 0;
    }
    int state = __atomic_load_n(&ld->items[i].state, __ATOMIC_ACQUIRE);
    if (state != PENDING)
        return PyLong_FromLong(state); /* landed already: no GIL hand-off */
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    if (t >= 0)
        deadline_ts(&ts, t);
    pthread_mutex_lock(&ld->mu);
    __atomic_add_fetch(&ld->waiters, 1, __ATOMIC_SEQ_CST);
    while (__atomic_load_n(&ld->items[i].state, __ATOMIC_SEQ_CST) == PENDING && !ld->finished) {
        if (t < 0)
            pthread_cond_wait(&ld->cv, &ld->mu);
        else if (pthread_cond_timedwait(&ld->cv, &ld->mu, &ts) == ETIMEDOUT)
            break;
    }
    __atomic_sub_fetch(&ld->waiters, 1, __ATOMIC_SEQ_CST);
    state = ld->items[i].state;
    pthread_mutex_unlock(&ld->mu);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(state);
}

static PyObject *Load_stop(Load *ld, PyObject *args) {
    int limit;
    if (!PyArg_ParseTuple(args, "i", &limit))
        return NULL;
    pthread_mutex_lock(&ld->mu);
    if (limit < ld->limit)
        __atomic_store_n(&ld->limit, limit < 0 ? 0 : limit, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&ld->cv);
    pthread_mutex_unlock(&ld->mu);
    Py_RETURN_NONE;
}

/* Object i's outcome: (state, errno, fd, bytes read, mtime, opened_s, t0:
 * when its open began, in time.perf_counter()'s seconds, exact: OK with the
 * header expected, see ``header_exact``). The
 * fd (-1 if never opened, or closed by the loop: see ``close_fresh``) is
 * the caller's to close once ``run`` returned or the object is OK. */
static PyObject *Load_item(Load *ld, PyObject *args) {
    int i;
    if (!PyArg_ParseTuple(args, "i", &i) || check_index(ld, i))
        return NULL;
    pthread_mutex_lock(&ld->mu);
    item_t it = ld->items[i];
    pthread_mutex_unlock(&ld->mu);
    return Py_BuildValue("(iiindddi)", it.state, it.err, it.fd, (Py_ssize_t)it.size, it.mtime, it.opened_s, it.t0,
                         it.state == OK && it.exact);
}

static PyObject *Load_times(Load *ld, PyObject *unused) {
    pthread_mutex_lock(&ld->mu);
    PyObject *r = Py_BuildValue("(ddii)", ld->opening_s, ld->active_s, ld->refused, ld->broken);
    pthread_mutex_unlock(&ld->mu);
    return r;
}

/* The trace: [(time.perf_counter() seconds, pieces +submitted/-landed)]. */
static PyObject *Load_events(Load *ld, PyObject *unused) {
    pthread_mutex_lock(&ld->mu);
    int done = ld->finished;
    pthread_mutex_unlock(&ld->mu);
    if (!done) {
        PyErr_SetString(PyExc_RuntimeError, "events() once run() returned");
        return NULL;
    }
    PyObject *out = PyList_New(ld->nev);
    for (int k = 0; out && k < ld->nev; k++) {
        PyObject *e = Py_BuildValue("(di)", ld->ev_t[k], ld->ev_d[k]);
        if (!e) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, e);
    }
    return out;
}

static PyMethodDef Load_methods[] = {
    {"events", (PyCFunction)Load_events, METH_NOARGS, "The trace, once run returned."},
    {"run", (PyCFunction)Load_run, METH_VARARGS,
     "run(base_fd): read the load's objects, their paths below that folder (blocks; no GIL held); "
     "base_fd < 0: none (each ends SKIPPED)."},
    {"give", (PyCFunction)Load_give, METH_VARARGS,
     "give(i, buffers): objects i, i+1, ... their buffers (writable, each at least its object's length)."},
    {"wait", (PyCFunction)Load_wait, METH_VARARGS, "wait(i, timeout_s or None) -> state."},
    {"stop", (PyCFunction)Load_stop, METH_VARARGS, "stop(limit): read nothing from index limit on."},
    {"item", (PyCFunction)Load_item, METH_VARARGS, "item(i) -> (state, errno, fd, got, mtime, opened_s, t0, exact)."},
    {"times", (PyCFunction)Load_times, METH_NOARGS, "(opening_s, active_s, refused, broken: io_getevents failed) once run returned."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject LoadType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "kvtier._readloop.Load",
    .tp_basicsize = sizeof(Load),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Load_init,
    .tp_dealloc = (destructor)Load_dealloc,
    .tp_methods = Load_methods,
    .tp_doc = "One load's reads (see the module's docstring).",
};

static PyObject *set_hash(PyObject *self, PyObject *args) {
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "K", &addr))
        return NULL;
    xxh3_128 = (xxh3_128_fn)(uintptr_t)addr;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_hash", set_hash, METH_VARARGS, "set_hash(address of XXH3_128bits)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvtier._readloop",
    "A directory tier's O_DIRECT load without the GIL (see readloop.c).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__readloop(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xedb88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
    if (PyType_Ready(&LoadType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&LoadType);
    if (PyModule_AddObject(m, "Load", (PyObject *)&LoadType) < 0) {
        Py_DECREF(&LoadType);
        Py_DECREF(m);
        return NULL;
    }
    PyModule_AddIntConstant(m, "PENDING", PENDING);
    PyModule_AddIntConstant(m, "OK", OK);
    PyModule_AddIntConstant(m, "FALLBACK", FALLBACK);
    PyModule_AddIntConstant(m, "SKIPPED", SKIPPED);
    PyModule_AddIntConstant(m, "HEADER_STRUCT_SIZE", HEADER_STRUCT_SIZE);
    PyModule_AddIntConstant(m, "HEAD_EXPECTED", HEAD_EXPECTED);
    PyModule_AddIntConstant(m, "HEAD_CRC_AT", HEAD_CRC_AT);
    return m;
}
