/* io_uring engine for file and block namespaces (csrc/uring.h), and its Python type `_native.Uring`.
 *
 * One ring per poll group. Commands are queued (an SQE each, cookie in user_data), submitted in one
 * io_uring_enter per batch, and their completions announced on an eventfd registered with the ring, so the
 * caller's event loop wakes on them instead of a thread handing them over. The number in flight is bounded
 * by the depth given at creation, which the CQ (twice the SQ) always holds: no completion is ever dropped. */
/* Built without Python (-DNATIVE_PLAIN_C) for tests/native/nq_hot_test.c: the ring and its fault hook, not the
 * Python type or the hook's Python calls. */
#ifndef NATIVE_PLAIN_C
#include "native.h"
#endif
#include "uring.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <liburing.h>

#ifndef RWF_DSYNC
#define RWF_DSYNC 0x00000002
#endif

struct nr_uring {
    struct io_uring ring;
    int efd;
    unsigned depth;     /* most commands queued + submitted and not yet reaped */
    unsigned in_flight; /* commands queued + submitted and not yet reaped (a stalled one too) */
    /* completions the fault injection stalls (below): NULL until one is; nheld <= depth; the first nreleased
     * are reported by the next reap */
    struct nr_uring_done *held;
    unsigned nheld, nreleased;
    struct nr_uring *next_stalled; /* on the list of rings holding completions */
    int cancelled;      /* nr_uring_cancel asked the kernel to cancel what it can */
};

/* ---------------------------------------------------------------------------------------------------------
 * Fault injection, a test hook (as SPDK's bdev error injection): `_native.uring_inject(kind, count)` makes the
 * next `count` completions reaped from any ring fail with -EIO, -ECANCELED or -EAGAIN in place of their result,
 * or stalls them (reaped from the kernel, not reported, the command still in flight) until
 * `_native.uring_release(n)`.  It is in the product module because the rings it acts on are made and reaped
 * here, inside csrc/nq_hot.c's per-queue data path and `_native.Uring`, where no test double can stand in for the
 * kernel.  Inert unless armed: `nr_uring_reap` tests one flag, false in production, and takes the slow path
 * (under a mutex) only while a fault is armed or a completion is held. */

enum uring_fault_kind { URING_FAULT_NONE, URING_FAULT_EIO, URING_FAULT_ECANCELED, URING_FAULT_EAGAIN, URING_FAULT_STALL };

static const char *const uring_fault_names[] __attribute__((unused)) = {"none", "eio", "ecanceled", "eagain", "stall"};

static struct {
    int active; /* read without the lock: a fault is armed (remaining) or a ring holds completions */
    pthread_mutex_t lock;
    enum uring_fault_kind kind;
    unsigned remaining;        /* completions the armed fault still applies to */
    unsigned held;             /* completions held by every ring */
    unsigned long long injected; /* completions the faults applied to so far */
    struct nr_uring *stalled;  /* rings holding completions */
} uring_fault = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void uring_fault_update_active(void) /* under the lock */
{
    __atomic_store_n(&uring_fault.active, uring_fault.remaining || uring_fault.held, __ATOMIC_RELEASE);
}

static void uring_fault_unlink(struct nr_uring *r) /* under the lock */
{
    for (struct nr_uring **p = &uring_fault.stalled; *p; p = &(*p)->next_stalled)
        if (*p == r) {
            *p = r->next_stalled;
            r->next_stalled = NULL;
            return;
        }
}

/* nr_uring_reap while faults are armed or completions held: released completions first, then the kernel's, each
 * one the armed fault applies to changed or held. */
static int uring_reap_faulted(struct nr_uring *r, struct nr_uring_done *out, int max)
{
    struct io_uring_cqe *cqe;
    unsigned head, consumed = 0;
    int n = 0;

    pthread_mutex_lock(&uring_fault.lock);
    while (n < max && r->nreleased) {
        out[n++] = r->held[0];
        memmove(r->held, r->held + 1, (r->nheld - 1) * sizeof(*r->held));
        r->nheld--;
        r->nreleased--;
        uring_fault.held--;
    }
    io_uring_for_each_cqe(&r->ring, head, cqe) {
        if (n == max)
            break;
        struct nr_uring_done done = {io_uring_cqe_get_data64(cqe), cqe->res};
        consumed++;
        if (uring_fault.remaining) {
            uring_fault.remaining--;
            uring_fault.injected++;
            if (uring_fault.kind == URING_FAULT_STALL) {
                if (!r->held)
                    r->held = calloc(r->depth, sizeof(*r->held)); /* test-only path: never in production */
                if (r->held) {
                    if (!r->nheld)
                        r->next_stalled = uring_fault.stalled, uring_fault.stalled = r;
                    r->held[r->nheld++] = done;
                    uring_fault.held++;
                    continue;
                }
            }
            done.res = uring_fault.kind == URING_FAULT_EIO         ? -EIO
                       : uring_fault.kind == URING_FAULT_ECANCELED ? -ECANCELED
                       : uring_fault.kind == URING_FAULT_EAGAIN    ? -EAGAIN
                                                                   : done.res;
        }
        out[n++] = done;
    }
    io_uring_cq_advance(&r->ring, consumed);
    if (!r->nheld && r->held)
        uring_fault_unlink(r);
    uring_fault_update_active();
    pthread_mutex_unlock(&uring_fault.lock);
    r->in_flight -= n;
    return n;
}

/* Drops the completions a ring holds (it is being destroyed: their commands are complete in the kernel). */
static void uring_fault_forget(struct nr_uring *r)
{
    pthread_mutex_lock(&uring_fault.lock);
    if (r->nheld)
        uring_fault_unlink(r);
    uring_fault.held -= r->nheld;
    r->in_flight -= r->nheld;
    r->nheld = r->nreleased = 0;
    uring_fault_update_active();
    pthread_mutex_unlock(&uring_fault.lock);
    free(r->held);
    r->held = NULL;
}

struct nr_uring *nr_uring_create(unsigned depth, int *err)
{
    struct nr_uring *r;
    int ret;

    if (depth == 0 || depth > 4096) {
        *err = -EINVAL;
        return NULL;
    }
    r = calloc(1, sizeof(*r));
    if (!r) {
        *err = -ENOMEM;
        return NULL;
    }
    r->depth = depth;
    /* SUBMIT_ALL (5.18): a command that fails at submission does not hold back the rest of its batch;
     * without it (older kernels) those stay queued and go with the next submit. */
    ret = io_uring_queue_init(depth, &r->ring, IORING_SETUP_SUBMIT_ALL);
    if (ret == -EINVAL)
        ret = io_uring_queue_init(depth, &r->ring, 0);
    if (ret < 0) {
        free(r);
        *err = ret;
        return NULL;
    }
    r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->efd < 0) {
        *err = -errno;
        io_uring_queue_exit(&r->ring);
        free(r);
        return NULL;
    }
    ret = io_uring_register_eventfd(&r->ring, r->efd);
    if (ret < 0) {
        *err = ret;
        close(r->efd);
        io_uring_queue_exit(&r->ring);
        free(r);
        return NULL;
    }
    *err = 0;
    return r;
}

int nr_uring_eventfd(struct nr_uring *r)
{
    return r->efd;
}

unsigned nr_uring_in_flight(struct nr_uring *r)
{
    return r->in_flight;
}

static struct io_uring_sqe *take_sqe(struct nr_uring *r)
{
    struct io_uring_sqe *sqe;

    if (r->in_flight >= r->depth)
        return NULL;
    sqe = io_uring_get_sqe(&r->ring);
    if (sqe)
        r->in_flight++;
    return sqe;
}

static int queue_rw(struct nr_uring *r, int write, int fd, const void *buf, size_t len, uint64_t off,
                    uint64_t cookie, int rw_flags)
{
    struct io_uring_sqe *sqe;

    if (len > UINT_MAX || off > (uint64_t)LLONG_MAX)
        return -EINVAL;
    sqe = take_sqe(r);
    if (!sqe)
        return -EBUSY;
    if (write)
        io_uring_prep_write(sqe, fd, buf, (unsigned)len, off);
    else
        io_uring_prep_read(sqe, fd, (void *)buf, (unsigned)len, off);
    sqe->rw_flags = rw_flags;
    io_uring_sqe_set_data64(sqe, cookie);
    return 0;
}

int nr_uring_read(struct nr_uring *r, int fd, void *buf, size_t len, uint64_t off, uint64_t cookie)
{
    return queue_rw(r, 0, fd, buf, len, off, cookie, 0);
}

int nr_uring_write(struct nr_uring *r, int fd, const void *buf, size_t len, uint64_t off, uint64_t cookie)
{
    return queue_rw(r, 1, fd, buf, len, off, cookie, 0);
}

int nr_uring_write_fua(struct nr_uring *r, int fd, const void *buf, size_t len, uint64_t off, uint64_t cookie)
{
    return queue_rw(r, 1, fd, buf, len, off, cookie, RWF_DSYNC);
}

int nr_uring_fsync(struct nr_uring *r, int fd, uint64_t cookie)
{
    struct io_uring_sqe *sqe = take_sqe(r);

    if (!sqe)
        return -EBUSY;
    io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC);
    io_uring_sqe_set_data64(sqe, cookie);
    return 0;
}

int nr_uring_submit(struct nr_uring *r)
{
    int ret;

    do
        ret = io_uring_submit(&r->ring);
    while (ret == -EINTR);
    return ret;
}

int nr_uring_reap(struct nr_uring *r, struct nr_uring_done *out, int max)
{
    struct io_uring_cqe *cqe;
    unsigned head;
    int n = 0;

    if (__builtin_expect(__atomic_load_n(&uring_fault.active, __ATOMIC_RELAXED), 0))
        return uring_reap_faulted(r, out, max);

    io_uring_for_each_cqe(&r->ring, head, cqe) {
        if (n == max)
            break;
        out[n].cookie = io_uring_cqe_get_data64(cqe);
        out[n].res = cqe->res;
        n++;
    }
    io_uring_cq_advance(&r->ring, n);
    r->in_flight -= n;
    return n;
}

int nr_uring_wait(struct nr_uring *r, int timeout_ms)
{
    struct pollfd pfd = {.fd = r->efd, .events = POLLIN};
    uint64_t count;
    int ret;

    if (io_uring_cq_ready(&r->ring) || __atomic_load_n(&r->nreleased, __ATOMIC_RELAXED))
        return 0;
    /* clear the eventfd, then look again: a completion posted after this read signals it anew */
    if (read(r->efd, &count, sizeof(count)) < 0 && errno != EAGAIN)
        return -errno;
    if (io_uring_cq_ready(&r->ring))
        return 0;
    ret = poll(&pfd, 1, timeout_ms);
    if (ret < 0)
        return -errno;
    return ret ? 0 : -ETIME;
}

#define CANCEL_COOKIE NR_URING_CANCEL_COOKIE

void nr_uring_cancel(struct nr_uring *r)
{
    struct io_uring_sqe *sqe;

    if (io_uring_sq_ready(&r->ring))
        nr_uring_submit(r); /* a failed submit leaves them queued: the next call tries again */
    if (r->cancelled || !r->in_flight || (sqe = io_uring_get_sqe(&r->ring)) == NULL)
        return;
    io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
    io_uring_sqe_set_data64(sqe, CANCEL_COOKIE);
    r->in_flight++; /* its completion is reaped with the others */
    r->cancelled = 1;
    nr_uring_submit(r);
}

void nr_uring_destroy(struct nr_uring *r)
{
    struct io_uring_cqe *cqe;
    struct io_uring_sqe *sqe;
    unsigned head, n;

    if (!r)
        return;
    if (r->held)
        uring_fault_forget(r);
    /* The kernel may still write into the callers' buffers until each command completes: cancel what can be
     * cancelled (a read waiting on a pipe or a socket; 5.19's CANCEL_ANY, ignored before), wait for the rest. */
    if (io_uring_sq_ready(&r->ring))
        nr_uring_submit(r);
    if (r->in_flight && !r->cancelled && (sqe = io_uring_get_sqe(&r->ring)) != NULL) {
        io_uring_prep_cancel64(sqe, 0, IORING_ASYNC_CANCEL_ANY);
        io_uring_sqe_set_data64(sqe, CANCEL_COOKIE);
        nr_uring_submit(r);
    }
    while (r->in_flight) {
        n = 0;
        io_uring_for_each_cqe(&r->ring, head, cqe) {
            n++;
            /* nr_uring_cancel's cancel is counted in flight (its completion not reaped yet), this one is not */
            if (io_uring_cqe_get_data64(cqe) != CANCEL_COOKIE || r->cancelled)
                r->in_flight--;
        }
        io_uring_cq_advance(&r->ring, n);
        if (n == 0 && nr_uring_wait(r, -1) < 0 && errno != EINTR)
            break;
    }
    io_uring_queue_exit(&r->ring);
    close(r->efd);
    free(r);
}

#ifndef NATIVE_PLAIN_C
/* ---------------------------------------------------------------------------------------------------------
 * The Python face: _native.Uring(depth). Each command holds its buffer (a buffer export, so an mmap cannot be
 * closed or resized under the kernel) and its cookie, any Python object, in a slot until it is reaped. */

struct uring_slot {
    PyObject *cookie; /* NULL: the slot is free */
    Py_buffer view;   /* view.obj NULL: no buffer (fsync) */
    int next_free;
};

typedef struct {
    PyObject_HEAD
    struct nr_uring *ring;
    struct uring_slot *slots;
    int free_slot; /* head of the free list, -1 when full */
    unsigned depth;
    struct nr_uring_done done[64];
} UringObject;

static PyObject *raise_errno(int neg_errno)
{
    errno = -neg_errno;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static int uring_init(UringObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"depth", NULL};
    unsigned depth;
    int err;

    if (self->ring) {
        PyErr_SetString(PyExc_RuntimeError, "Uring is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "I", kwlist, &depth))
        return -1;
    if (depth == 0 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "depth must be 1..4096, got %u", depth);
        return -1;
    }
    self->slots = PyMem_Calloc(depth, sizeof(*self->slots));
    if (!self->slots) {
        PyErr_NoMemory();
        return -1;
    }
    for (unsigned i = 0; i < depth; i++)
        self->slots[i].next_free = i + 1 < depth ? (int)i + 1 : -1;
    self->free_slot = 0;
    self->depth = depth;
    self->ring = nr_uring_create(depth, &err);
    if (!self->ring) {
        PyMem_Free(self->slots);
        self->slots = NULL;
        raise_errno(err);
        return -1;
    }
    return 0;
}

static int check_open(UringObject *self)
{
    if (!self->ring) {
        PyErr_SetString(PyExc_ValueError, "the ring is closed");
        return -1;
    }
    return 0;
}

/* A free slot holding `cookie` (a new reference), or -1 with an exception set. */
static int take_slot(UringObject *self, PyObject *cookie)
{
    int i = self->free_slot;

    if (i < 0) {
        errno = EBUSY;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    self->free_slot = self->slots[i].next_free;
    Py_INCREF(cookie);
    self->slots[i].cookie = cookie;
    self->slots[i].view.obj = NULL;
    return i;
}

/* The slot's cookie (the reference passes to the caller); its buffer released, the slot freed. */
static PyObject *give_slot(UringObject *self, int i)
{
    struct uring_slot *s = &self->slots[i];
    PyObject *cookie = s->cookie;

    if (s->view.obj)
        PyBuffer_Release(&s->view);
    s->cookie = NULL;
    s->next_free = self->free_slot;
    self->free_slot = i;
    return cookie;
}

static PyObject *queue_io(UringObject *self, PyObject *args, int write)
{
    int fd, fua = 0, slot, ret;
    unsigned long long offset;
    PyObject *buffer, *cookie;
    struct uring_slot *s;

    if (check_open(self) < 0)
        return NULL;
    if (!PyArg_ParseTuple(args, write ? "iOKO|p:write" : "iOKO:read", &fd, &buffer, &offset, &cookie, &fua))
        return NULL;
    slot = take_slot(self, cookie);
    if (slot < 0)
        return NULL;
    s = &self->slots[slot];
    if (PyObject_GetBuffer(buffer, &s->view, write ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0) {
        s->view.obj = NULL;
        Py_DECREF(give_slot(self, slot));
        return NULL;
    }
    if (write)
        ret = (fua ? nr_uring_write_fua : nr_uring_write)(self->ring, fd, s->view.buf, s->view.len, offset, slot);
    else
        ret = nr_uring_read(self->ring, fd, s->view.buf, s->view.len, offset, slot);
    if (ret < 0) {
        Py_DECREF(give_slot(self, slot));
        return raise_errno(ret);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(uring_read_doc, "read(fd, buffer, offset, cookie): queue a read filling the writable buffer.");
static PyObject *uring_read(UringObject *self, PyObject *args)
{
    return queue_io(self, args, 0);
}

PyDoc_STRVAR(uring_write_doc,
             "write(fd, buffer, offset, cookie, fua=False): queue a write of the buffer; with fua, durable when "
             "it completes (RWF_DSYNC).");
static PyObject *uring_write(UringObject *self, PyObject *args)
{
    return queue_io(self, args, 1);
}

PyDoc_STRVAR(uring_fsync_doc, "fsync(fd, cookie): queue an fdatasync.");
static PyObject *uring_fsync(UringObject *self, PyObject *args)
{
    int fd, slot, ret;
    PyObject *cookie;

    if (check_open(self) < 0 || !PyArg_ParseTuple(args, "iO", &fd, &cookie))
        return NULL;
    slot = take_slot(self, cookie);
    if (slot < 0)
        return NULL;
    ret = nr_uring_fsync(self->ring, fd, slot);
    if (ret < 0) {
        Py_DECREF(give_slot(self, slot));
        return raise_errno(ret);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(uring_submit_doc, "submit() -> int: hand the queued commands to the kernel in one system call.");
static PyObject *uring_submit(UringObject *self, PyObject *noargs)
{
    int ret;

    if (check_open(self) < 0)
        return NULL;
    ret = nr_uring_submit(self->ring);
    if (ret < 0)
        return raise_errno(ret);
    return PyLong_FromLong(ret);
}

static void clear_eventfd(UringObject *self)
{
    uint64_t count;
    ssize_t ignored = read(nr_uring_eventfd(self->ring), &count, sizeof(count));
    (void)ignored;
}

PyDoc_STRVAR(uring_reap_doc,
             "reap() -> [(cookie, res), ...]: every completion ready (res: bytes, or -errno), without "
             "blocking; clears the eventfd first, so a completion that comes later makes it readable again.");
static PyObject *uring_reap(UringObject *self, PyObject *noargs)
{
    PyObject *out, *item;
    int n;

    if (check_open(self) < 0)
        return NULL;
    clear_eventfd(self);
    out = PyList_New(0);
    if (!out)
        return NULL;
    do {
        n = nr_uring_reap(self->ring, self->done, 64);
        for (int i = 0; i < n; i++) {
            PyObject *cookie = give_slot(self, (int)self->done[i].cookie);
            item = Py_BuildValue("(Ni)", cookie, self->done[i].res);
            if (!item || PyList_Append(out, item) < 0) {
                /* the rest of this batch is already reaped: their cookies are dropped with the error */
                Py_XDECREF(item);
                for (int j = i + 1; j < n; j++)
                    Py_DECREF(give_slot(self, (int)self->done[j].cookie));
                Py_DECREF(out);
                return NULL;
            }
            Py_DECREF(item);
        }
    } while (n == 64);
    return out;
}

PyDoc_STRVAR(uring_wait_doc,
             "wait(timeout) -> bool: block (without the GIL) until a completion is ready, at most timeout "
             "seconds (None: no limit); whether one is.");
static PyObject *uring_wait(UringObject *self, PyObject *args)
{
    PyObject *timeout = Py_None;
    int ms = -1, ret;

    if (check_open(self) < 0 || !PyArg_ParseTuple(args, "|O", &timeout))
        return NULL;
    if (timeout != Py_None) {
        double t = PyFloat_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred())
            return NULL;
        ms = t <= 0 ? 0 : t > INT_MAX / 1000 ? INT_MAX : (int)(t * 1000 + 0.999);
    }
    Py_BEGIN_ALLOW_THREADS
    do
        ret = nr_uring_wait(self->ring, ms);
    while (ret == -EINTR && ms < 0);
    Py_END_ALLOW_THREADS
    if (ret == -ETIME || ret == -EINTR)
        Py_RETURN_FALSE;
    if (ret < 0)
        return raise_errno(ret);
    Py_RETURN_TRUE;
}

static void uring_release(UringObject *self)
{
    if (self->ring) {
        struct nr_uring *ring = self->ring;
        self->ring = NULL;
        /* waits for the commands in flight: their buffers are released only after */
        Py_BEGIN_ALLOW_THREADS
        nr_uring_destroy(ring);
        Py_END_ALLOW_THREADS
    }
    if (self->slots) {
        for (unsigned i = 0; i < self->depth; i++)
            if (self->slots[i].cookie)
                Py_DECREF(give_slot(self, (int)i));
        PyMem_Free(self->slots);
        self->slots = NULL;
    }
}

PyDoc_STRVAR(uring_close_doc,
             "close(): wait for the commands in flight (their completions are dropped), free the ring and "
             "close its eventfd.");
static PyObject *uring_close(UringObject *self, PyObject *noargs)
{
    uring_release(self);
    Py_RETURN_NONE;
}

static PyObject *uring_fileno(UringObject *self, PyObject *noargs)
{
    if (check_open(self) < 0)
        return NULL;
    return PyLong_FromLong(nr_uring_eventfd(self->ring));
}

static PyObject *uring_get_in_flight(UringObject *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->ring ? nr_uring_in_flight(self->ring) : 0);
}

static PyObject *uring_get_depth(UringObject *self, void *closure)
{
    return PyLong_FromUnsignedLong(self->depth);
}

static PyObject *uring_get_closed(UringObject *self, void *closure)
{
    return PyBool_FromLong(self->ring == NULL);
}

static void uring_dealloc(UringObject *self)
{
    uring_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef uring_methods[] = {
    {"read", (PyCFunction)uring_read, METH_VARARGS, uring_read_doc},
    {"write", (PyCFunction)uring_write, METH_VARARGS, uring_write_doc},
    {"fsync", (PyCFunction)uring_fsync, METH_VARARGS, uring_fsync_doc},
    {"submit", (PyCFunction)uring_submit, METH_NOARGS, uring_submit_doc},
    {"reap", (PyCFunction)uring_reap, METH_NOARGS, uring_reap_doc},
    {"wait", (PyCFunction)uring_wait, METH_VARARGS, uring_wait_doc},
    {"close", (PyCFunction)uring_close, METH_NOARGS, uring_close_doc},
    {"fileno", (PyCFunction)uring_fileno, METH_NOARGS, "fileno() -> int: the eventfd, readable when completions are ready."},
    {NULL},
};

static PyGetSetDef uring_getset[] = {
    {"in_flight", (getter)uring_get_in_flight, NULL, "commands queued or submitted, not yet reaped", NULL},
    {"depth", (getter)uring_get_depth, NULL, "most commands in flight at once", NULL},
    {"closed", (getter)uring_get_closed, NULL, "close() was called", NULL},
    {NULL},
};

static PyTypeObject UringType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nvmeof_roce._native.Uring",
    .tp_doc = PyDoc_STR("Uring(depth): an io_uring with room for `depth` commands in flight; completions are "
                        "announced on its eventfd (fileno()) and collected with reap()."),
    .tp_basicsize = sizeof(UringObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)uring_init,
    .tp_dealloc = (destructor)uring_dealloc,
    .tp_methods = uring_methods,
    .tp_getset = uring_getset,
};

PyDoc_STRVAR(uring_probe_doc,
             "uring_probe(): None when io_uring works here (io_uring_setup and an eventfd registration); "
             "raises OSError with the kernel's errno otherwise (ENOSYS: not built in, EPERM: forbidden by "
             "seccomp or kernel.io_uring_disabled).");
static PyObject *uring_probe(PyObject *module, PyObject *noargs)
{
    int err;
    struct nr_uring *r = nr_uring_create(1, &err);

    if (!r)
        return raise_errno(err);
    nr_uring_destroy(r);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(uring_inject_doc,
             "uring_inject(kind, count=1): a test hook, inert unless called: the next `count` completions reaped "
             "from any ring (the native queues' and every Uring) get res -EIO (kind 'eio'), -ECANCELED "
             "('ecanceled') or -EAGAIN ('eagain'), or are stalled ('stall': held back, their commands still in "
             "flight, until uring_release). kind 'none' or count 0 disarms (held completions stay held).");
static PyObject *uring_fault_inject(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"kind", "count", NULL};
    const char *name;
    unsigned count = 1;
    int kind = -1;

    if (!PyArg_ParseTupleAndKeywords(args, kwds, "s|I:uring_inject", kwlist, &name, &count))
        return NULL;
    for (int i = 0; i < (int)(sizeof(uring_fault_names) / sizeof(*uring_fault_names)); i++)
        if (!strcmp(name, uring_fault_names[i]))
            kind = i;
    if (kind < 0) {
        PyErr_Format(PyExc_ValueError, "unknown io_uring fault '%s': eio, ecanceled, eagain, stall or none", name);
        return NULL;
    }
    pthread_mutex_lock(&uring_fault.lock);
    uring_fault.kind = (enum uring_fault_kind)kind;
    uring_fault.remaining = kind == URING_FAULT_NONE ? 0 : count;
    uring_fault_update_active();
    pthread_mutex_unlock(&uring_fault.lock);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(uring_release_doc,
             "uring_release(n=None) -> int: a test hook: the next n stalled completions (all when None), oldest "
             "first, are reported by their ring's next reap (its eventfd is signalled); the number released.");
static PyObject *uring_fault_release(PyObject *module, PyObject *args)
{
    PyObject *limit = Py_None;
    unsigned long long left = ~0ULL;
    unsigned released = 0;

    if (!PyArg_ParseTuple(args, "|O:uring_release", &limit))
        return NULL;
    if (limit != Py_None) {
        left = PyLong_AsUnsignedLongLong(limit);
        if (left == (unsigned long long)-1 && PyErr_Occurred())
            return NULL;
    }
    pthread_mutex_lock(&uring_fault.lock);
    for (struct nr_uring *r = uring_fault.stalled; r && left; r = r->next_stalled) {
        unsigned more = r->nheld - r->nreleased;
        if (more > left)
            more = (unsigned)left;
        if (!more)
            continue;
        __atomic_store_n(&r->nreleased, r->nreleased + more, __ATOMIC_RELAXED);
        left -= more;
        released += more;
        uint64_t one = 1;
        ssize_t ignored = write(r->efd, &one, sizeof(one)); /* wakes whoever waits on the ring */
        (void)ignored;
    }
    pthread_mutex_unlock(&uring_fault.lock);
    return PyLong_FromUnsignedLong(released);
}

PyDoc_STRVAR(uring_faults_doc,
             "uring_faults() -> dict: a test hook's state: the armed kind, completions it still applies to "
             "(remaining), completions stalled now (held) and faulted so far (injected).");
static PyObject *uring_fault_state(PyObject *module, PyObject *noargs)
{
    pthread_mutex_lock(&uring_fault.lock);
    const char *kind = uring_fault_names[uring_fault.remaining ? uring_fault.kind : URING_FAULT_NONE];
    unsigned remaining = uring_fault.remaining, held = uring_fault.held;
    unsigned long long injected = uring_fault.injected;
    pthread_mutex_unlock(&uring_fault.lock);
    return Py_BuildValue("{s:s,s:I,s:I,s:K}", "kind", kind, "remaining", remaining, "held", held, "injected",
                         injected);
}

static PyMethodDef uring_functions[] = {
    {"uring_probe", uring_probe, METH_NOARGS, uring_probe_doc},
    {"uring_inject", (PyCFunction)(void (*)(void))uring_fault_inject, METH_VARARGS | METH_KEYWORDS, uring_inject_doc},
    {"uring_release", uring_fault_release, METH_VARARGS, uring_release_doc},
    {"uring_faults", uring_fault_state, METH_NOARGS, uring_faults_doc},
    {NULL},
};

int native_uring_register(PyObject *module)
{
    if (PyType_Ready(&UringType) < 0)
        return -1;
    Py_INCREF(&UringType);
    if (PyModule_AddObject(module, "Uring", (PyObject *)&UringType) < 0) {
        Py_DECREF(&UringType);
        return -1;
    }
    return PyModule_AddFunctions(module, uring_functions);
}
#endif /* NATIVE_PLAIN_C */
