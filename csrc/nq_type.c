/* The CPython type `_native.Queue` (its views' `_native.File`: csrc/nq_file.c): the owner of a native queue's hot path (csrc/nq_hot.c).
 * It parses the Python side's calls, installs the view, and turns what the hot path hands over (struct nq_hooks)
 * into calls of on_capsule / on_send_done / on_failure - or, for a poll group's queue, into the mailbox the event
 * loop drains (csrc/mailbox.c).  docs/native.md.
 */
#include "native.h"
#include "nq_file.h"
#include "nq_hot.h"
#include "nq_view.h"
#include "nq_threaded.h"
#include "trace.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    PyObject_HEAD
    struct nq_queue nq;
    PyObject *on_capsule, *on_send_done, *on_failure;
    PyObject *error_type, *error_value, *error_tb; /* a callback raised during a poll: re-raised after it */
} NativeQueue;

#define NQ_SELF(q) ((NativeQueue *)((char *)(q) - offsetof(NativeQueue, nq)))


/* ------------------------------------------------------------------ the hooks: to Python */

static void nq_keep_error(NativeQueue *self)
{
    self->nq.hook_error = 1; /* an adaptive poll stops spinning */
    if (self->error_type) { /* the first one is what the caller sees */
        PyErr_Clear();
        return;
    }
    PyErr_Fetch(&self->error_type, &self->error_value, &self->error_tb);
}

static void nq_call(NativeQueue *self, PyObject *callable, PyObject *args)
{
    if (!args) {
        nq_keep_error(self);
        return;
    }
    PyObject *res = PyObject_CallObject(callable, args);
    Py_DECREF(args);
    if (!res)
        nq_keep_error(self);
    else
        Py_DECREF(res);
}

/* on the event loop's thread, holding the GIL (a poll group's queue mails these instead) */
static void nq_hook_capsule(struct nq_queue *q, const char *capsule, uint32_t len, int handed_back)
{
    NativeQueue *self = NQ_SELF(q);
    nq_call(self, self->on_capsule, Py_BuildValue("(y#O)", capsule, (Py_ssize_t)len,
                                                  handed_back ? Py_True : Py_False));
}

static void nq_hook_send_done(struct nq_queue *q, uint64_t tag)
{
    NativeQueue *self = NQ_SELF(q);
    nq_call(self, self->on_send_done, Py_BuildValue("(K)", (unsigned long long)tag));
}

static void nq_hook_failure(struct nq_queue *q, int status, uint64_t wr_id)
{
    NativeQueue *self = NQ_SELF(q);
    if (self->on_failure != Py_None)
        nq_call(self, self->on_failure, Py_BuildValue("(iK)", status, (unsigned long long)wr_id));
}

static const struct nq_hooks nq_python_hooks = {nq_hook_capsule, nq_hook_send_done, nq_hook_failure};

/* ------------------------------------------------------------------ a poll group's queue */

static PyObject *nq_reraise(NativeQueue *self);

/* The Python side's calls on a poll group's queue hold its mutex (waiting for it without the GIL: the poll thread
 * never takes the GIL, so neither waits on the other). */
static inline void nq_lock(NativeQueue *self)
{
    struct nq_queue *q = &self->nq;
    if (!q->threaded || pthread_mutex_trylock(&q->lock) == 0)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->lock);
    Py_END_ALLOW_THREADS
}

static inline void nq_unlock(NativeQueue *self)
{
    if (self->nq.threaded)
        pthread_mutex_unlock(&self->nq.lock);
}

int native_queue_poll_threaded(void *queue, int budget)
{
    return nq_poll_threaded(&((NativeQueue *)queue)->nq, budget);
}

void native_queue_stop(void *queue)
{
    NativeQueue *self = queue;
    nq_lock(self);
    if (self->nq.state < NQ_Q_STOPPED) /* once: a group's close may stop a queue that left it already */
        nq_qmove(&self->nq.state, NQ_Q_STOPPED, self->nq.qid);
    nq_unlock(self);
}

static PyTypeObject NativeQueueType;

int native_queue_check(void *obj)
{
    return PyObject_TypeCheck((PyObject *)obj, &NativeQueueType);
}

int native_queue_attach(void *queue)
{
    struct nq_queue *q = &((NativeQueue *)queue)->nq;
    if (q->threaded) {
        PyErr_SetString(PyExc_RuntimeError, "the queue already belongs to a poll group");
        return -1;
    }
    if (q->state >= NQ_Q_CLOSED || !q->reqs) {
        PyErr_SetString(PyExc_ConnectionError, "the native queue is closed");
        return -1;
    }
    /* every capsule it can hold back (one per receive), every file command handed back (one per request slot),
     * every signaled send of the Python side, a failure, a closing queue's end */
    uint32_t size = q->recv_count + q->nreqs + q->sq_size + 3;
    if (nq_mailbox_init(&q->mail, size) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    q->drained = PyMem_Calloc(size, sizeof *q->drained);
    if (!q->drained) {
        nq_mailbox_free(&q->mail);
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&q->lock, NULL);
    q->threaded = 1;
    return q->mail.fd;
}

/* drain(): what the poll thread mailed, delivered in order to on_capsule / on_send_done / on_failure; the
 * capsules' receives are re-posted first (one doorbell, before any response of them).  Returns how many. */
static PyObject *NativeQueue_drain(NativeQueue *self, PyObject *noargs)
{
    struct nq_queue *q = &self->nq;
    if (!q->threaded)
        return PyLong_FromLong(0);
    nq_lock(self);
    nq_mailbox_clear_wake(&q->mail);
    uint32_t n = q->state >= NQ_Q_STOPPED ? 0 : q->mail.count;
    PyObject *capsules = PyTuple_New(n);
    if (!capsules) {
        nq_unlock(self);
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        struct nq_mail *e = &q->mail.ring[(q->mail.head + i) % q->mail.size];
        q->drained[i] = *e;
        PyObject *bytes;
        if (e->kind == NQ_MAIL_CAPSULE) {
            bytes = PyBytes_FromStringAndSize(q->recv_base + (size_t)e->a * q->recv_size, (Py_ssize_t)e->b);
        } else if (e->kind == NQ_MAIL_HANDBACK) {
            uint32_t len;
            const char *capsule = nq_handback_capsule(q, e->a, &len);
            bytes = PyBytes_FromStringAndSize(capsule, (Py_ssize_t)len);
        } else {
            continue;
        }
        if (!bytes) { /* left in the mailbox: the next drain tries again */
            nq_unlock(self);
            Py_DECREF(capsules);
            return NULL;
        }
        PyTuple_SET_ITEM(capsules, i, bytes);
    }
    /* every capsule made: the receives are re-posted, the handed-back commands' slots and chunks let go */
    for (uint32_t i = 0; i < n; i++) {
        if (q->drained[i].kind == NQ_MAIL_CAPSULE)
            q->repost[q->nrepost++] = q->drained[i].a;
        else if (q->drained[i].kind == NQ_MAIL_HANDBACK)
            nq_release(q, q->drained[i].a);
    }
    q->mail.head = (q->mail.head + n) % q->mail.size;
    q->mail.count = 0;
    nq_flush(q);
    nq_unlock(self);
    for (uint32_t i = 0; i < n; i++) {
        struct nq_mail *e = &q->drained[i];
        if (e->kind == NQ_MAIL_CAPSULE || e->kind == NQ_MAIL_HANDBACK)
            nq_call(self, self->on_capsule, PyTuple_Pack(2, PyTuple_GET_ITEM(capsules, i),
                                                         e->kind == NQ_MAIL_HANDBACK ? Py_True : Py_False));
        else if (e->kind == NQ_MAIL_SEND_DONE)
            nq_call(self, self->on_send_done, Py_BuildValue("(K)", (unsigned long long)e->b));
        else if (e->kind == NQ_MAIL_FAILURE && self->on_failure != Py_None)
            nq_call(self, self->on_failure, Py_BuildValue("(iK)", (int)e->a, (unsigned long long)e->b));
    }
    Py_DECREF(capsules);
    if (self->error_type)
        return nq_reraise(self);
    return PyLong_FromUnsignedLong(n);
}


/* ------------------------------------------------------------------ the Python types */

static int nq_ptr(PyObject *obj, void **out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (PyErr_Occurred())
        return 0;
    *out = (void *)(uintptr_t)v;
    return 1;
}

static int nq_region(PyObject *obj, char **base, uint32_t *lkey, uint32_t *len)
{
    if (obj == Py_None) {
        *base = NULL;
        *lkey = *len = 0;
        return 1;
    }
    unsigned long long addr;
    unsigned int key, length;
    if (!PyArg_ParseTuple(obj, "KII", &addr, &key, &length))
        return 0;
    *base = (char *)(uintptr_t)addr;
    *lkey = key;
    *len = length;
    return 1;
}

static void NativeQueue_dealloc(NativeQueue *self)
{
    struct nq_queue *q = &self->nq;
    if (q->threaded) { /* a poll group holds a reference while it polls: none polls it now */
        nq_mailbox_free(&q->mail);
        PyMem_Free(q->drained);
        pthread_mutex_destroy(&q->lock);
    }
    nq_view_free(q->view);
    q->view = NULL;
    nt_ring_free(q->trace);
    q->trace = NULL;
    nq_queue_free(q);
    Py_XDECREF(self->on_capsule);
    Py_XDECREF(self->on_send_done);
    Py_XDECREF(self->on_failure);
    Py_XDECREF(self->error_type);
    Py_XDECREF(self->error_value);
    Py_XDECREF(self->error_tb);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int NativeQueue_init(NativeQueue *self, PyObject *args, PyObject *kwds)
{
    struct nq_queue *q = &self->nq;
    static char *kwlist[] = {"qp", "send_cq", "recv_cq", "qid", "recv", "recv_count", "recv_size", "requests",
                             "send_queue", "python_send", "reads", "on_capsule", "on_send_done", "on_failure",
                             "zero", "sink", "remote_invalidate", NULL};
    PyObject *qp, *scq, *rcq, *recv = NULL, *on_capsule = NULL, *on_send_done = Py_None, *on_failure = Py_None;
    PyObject *zero = Py_None, *sink = Py_None;
    unsigned int qid = 0, recv_count = 0, recv_size = 0, nreqs = 0, sq_size = 0, python_send = 0, reads = 0;
    int remote_invalidate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|$IOIIIIIIOOOOOp", kwlist, &qp, &scq, &rcq, &qid, &recv,
                                     &recv_count, &recv_size, &nreqs, &sq_size, &python_send, &reads, &on_capsule,
                                     &on_send_done, &on_failure, &zero, &sink, &remote_invalidate))
        return -1;
    if (!recv || !on_capsule) {
        PyErr_SetString(PyExc_TypeError, "recv and on_capsule are required");
        return -1;
    }
    if (q->reqs) {
        PyErr_SetString(PyExc_RuntimeError, "a native queue is initialised once");
        return -1;
    }
    struct nq_params params = {.qid = (uint16_t)qid, .recv_count = recv_count, .recv_size = recv_size,
                               .requests = nreqs, .send_queue = sq_size, .python_send = python_send, .reads = reads,
                               .remote_invalidate = remote_invalidate, .hooks = &nq_python_hooks,
                               .tell_send_done = on_send_done != Py_None};
    void *p;
    if (!nq_ptr(qp, &p)) return -1;
    params.qp = p;
    if (!nq_ptr(scq, &p)) return -1;
    params.send_cq = p;
    if (!nq_ptr(rcq, &p)) return -1;
    params.recv_cq = p;
    if (!params.qp || !params.send_cq || !params.recv_cq) {
        PyErr_SetString(PyExc_ValueError, "qp, send_cq and recv_cq must be the addresses of verbs objects");
        return -1;
    }
    uint32_t recv_len;
    if (!nq_region(recv, &params.recv_base, &params.recv_lkey, &recv_len) ||
        !nq_region(zero, &params.zero_base, &params.zero_lkey, &params.zero_len) ||
        !nq_region(sink, &params.sink_base, &params.sink_lkey, &params.sink_len))
        return -1;
    if (!recv_count || recv_size < NQ_SQE_SIZE || (uint64_t)recv_count * recv_size > recv_len || !nreqs ||
        python_send >= sq_size || !reads || nreqs >= (1u << 31)) {
        PyErr_Format(PyExc_ValueError, "native queue: recv_count %u x recv_size %u must fit the %u-byte receive "
                     "region (recv_size >= 64), requests > 0, python_send < send_queue, reads > 0",
                     recv_count, recv_size, recv_len);
        return -1;
    }
    if (!PyCallable_Check(on_capsule)) {
        PyErr_SetString(PyExc_TypeError, "on_capsule must be callable");
        return -1;
    }
    Py_INCREF(on_capsule);
    self->on_capsule = on_capsule;
    Py_INCREF(on_send_done);
    self->on_send_done = on_send_done;
    Py_INCREF(on_failure);
    self->on_failure = on_failure;
    int rc = nq_queue_init(q, &params);
    if (rc == -ENOMEM) {
        PyErr_NoMemory();
        return -1;
    }
    if (rc) {
        PyErr_Format(PyExc_OSError, "posting the receives failed (%d)", q->fail_status);
        return -1;
    }
    return 0;
}

static PyObject *nq_reraise(NativeQueue *self)
{
    if (!self->error_type)
        return NULL;
    PyErr_Restore(self->error_type, self->error_value, self->error_tb);
    self->error_type = self->error_value = self->error_tb = NULL;
    return NULL;
}

/* METH_FASTCALL: no argument tuple is allocated per poll */
static PyObject *NativeQueue_poll(NativeQueue *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct nq_queue *q = &self->nq;
    int budget = 256;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "poll(budget=256) takes at most one argument");
        return NULL;
    }
    if (nargs == 1) {
        budget = (int)PyLong_AsLong(args[0]);
        if (budget == -1 && PyErr_Occurred())
            return NULL;
    }
    if (q->threaded) { /* first: in_poll is the thread's */
        PyErr_SetString(PyExc_RuntimeError, "a poll group's thread polls this queue: drain() its mailbox");
        return NULL;
    }
    if (q->in_poll) {
        PyErr_SetString(PyExc_RuntimeError, "poll() called from inside a poll");
        return NULL;
    }
    int done = q->state >= NQ_Q_CLOSED ? 0 : nq_poll(q, budget);
    if (self->error_type)
        return nq_reraise(self);
    return PyLong_FromLong(done);
}

/* poll_adaptive(budget, spin_us) -> (handled, armed): `--poll adaptive` (nq_poll_adaptive).  armed False: the
 * budget was spent before the CQs were armed, call again (the caller's loop, before it sleeps). */
static PyObject *NativeQueue_poll_adaptive(NativeQueue *self, PyObject *const *args, Py_ssize_t nargs)
{
    struct nq_queue *q = &self->nq;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "poll_adaptive(budget, spin_us) takes two arguments");
        return NULL;
    }
    long budget = PyLong_AsLong(args[0]);
    if (budget == -1 && PyErr_Occurred())
        return NULL;
    double spin_us = PyFloat_AsDouble(args[1]);
    if (spin_us == -1.0 && PyErr_Occurred())
        return NULL;
    if (budget < 1 || budget > INT32_MAX || !(spin_us >= 0 && spin_us <= 1e6)) {
        PyErr_SetString(PyExc_ValueError, "poll_adaptive: budget must be at least 1 and spin_us 0..1000000");
        return NULL;
    }
    if (q->threaded) {
        PyErr_SetString(PyExc_RuntimeError, "a poll group's thread polls this queue: drain() its mailbox");
        return NULL;
    }
    if (q->in_poll) {
        PyErr_SetString(PyExc_RuntimeError, "poll_adaptive() called from inside a poll");
        return NULL;
    }
    int done = 0, armed = 0, arm_rc = 0;
    if (q->state < NQ_Q_CLOSED)
        done = nq_poll_adaptive(q, (int)budget, (uint64_t)(spin_us * 1000.0), &armed, &arm_rc);
    if (self->error_type)
        return nq_reraise(self);
    if (arm_rc) {
        errno = arm_rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(iO)", done, armed ? Py_True : Py_False);
}

static PyObject *NativeQueue_arm(NativeQueue *self, PyObject *noargs)
{
    struct nq_queue *q = &self->nq;
    if (q->state >= NQ_Q_CLOSED || q->threaded) /* a poll group's queue is polled, never armed */
        Py_RETURN_NONE;
    int rc = nq_arm(q);
    if (rc) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *nq_check_posting(NativeQueue *self)
{
    struct nq_queue *q = &self->nq;
    if (!nq_q_live(q)) {
        PyErr_SetString(PyExc_ConnectionError, "the native queue is closed");
        return NULL;
    }
    return Py_None;
}

/* post_read(tag, local_addr, lkey, length, remote_addr, rkey): the Python side's RDMA READ, signaled.  It takes
 * one of the queue's READ credits (the host granted them to the QP, not to either side), or waits in the queue
 * for the next one given back. */
static PyObject *nq_post_read(NativeQueue *self, PyObject *args)
{
    struct nq_queue *q = &self->nq;
    struct nq_py_read p;
    unsigned long long laddr, raddr;
    if (!PyArg_ParseTuple(args, "IKIIKI", &p.tag, &laddr, &p.lkey, &p.length, &raddr, &p.rkey))
        return NULL;
    p.laddr = laddr;
    p.raddr = raddr;
    if (!nq_check_posting(self))
        return NULL;
    if (nq_post_owner_read(q, &p) < 0) {
        PyErr_SetString(PyExc_OverflowError, "the send queue is full: the Python side overran its share");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* post_response(tag, cqe, signaled, data_addr, lkey, length, remote_addr, rkey, invalidate): the Python side's
 * response: its data WRITE (when length) chained before the inline SEND of the 16-byte CQE; invalidate is the
 * host's key to invalidate with it, or -1. */
static PyObject *nq_post_response(NativeQueue *self, PyObject *args)
{
    struct nq_queue *q = &self->nq;
    unsigned int tag, lkey, length, rkey;
    unsigned long long laddr, raddr;
    int signaled;
    long long invalidate;
    Py_buffer cqe;
    if (!PyArg_ParseTuple(args, "Iy*pKIIKIL", &tag, &cqe, &signaled, &laddr, &lkey, &length, &raddr, &rkey,
                          &invalidate))
        return NULL;
    if (cqe.len != NQ_CQE_SIZE) {
        PyBuffer_Release(&cqe);
        return PyErr_Format(PyExc_ValueError, "a response is %d bytes, not %zd", NQ_CQE_SIZE, cqe.len);
    }
    if (!nq_check_posting(self)) {
        PyBuffer_Release(&cqe);
        return NULL;
    }
    int rc = nq_post_owner_response(q, tag, cqe.buf, signaled, laddr, lkey, length, raddr, rkey, invalidate);
    PyBuffer_Release(&cqe);
    if (rc < 0) {
        PyErr_SetString(PyExc_OverflowError, "the send queue is full: the Python side overran its share");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* enable_files(bounce, chunk) -> the ring's eventfd: file and block namespaces may be in the view from now on.
 * bounce: (addr, lkey, length) of registered memory, page aligned (O_DIRECT), cut into chunks of `chunk` bytes: at
 * least one, at most one per request slot (more are not used); the ring has a place per slot. */
static PyObject *nq_enable_files_py(NativeQueue *self, PyObject *args)
{
    struct nq_queue *q = &self->nq;
    PyObject *bounce;
    unsigned int chunk;
    if (!PyArg_ParseTuple(args, "OI", &bounce, &chunk))
        return NULL;
    if (q->state >= NQ_Q_CLOSED)
        return PyErr_Format(PyExc_ConnectionError, "the native queue is closed");
    if (q->ring)
        return PyErr_Format(PyExc_RuntimeError, "enable_files() was called already");
    char *base;
    uint32_t lkey, len;
    if (!nq_region(bounce, &base, &lkey, &len))
        return NULL;
    if (!base || !chunk || chunk % 4096 || (uintptr_t)base % 4096 || chunk > len)
        return PyErr_Format(PyExc_ValueError, "enable_files: chunks of %u bytes (a multiple of 4096, at least one) "
                            "must fit the %u-byte page-aligned bounce region", chunk, len);
    int err = nq_enable_files(q, base, lkey, len, chunk);
    if (err == -ENOMEM)
        return PyErr_NoMemory();
    if (err) {
        errno = -err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromLong(nr_uring_eventfd(q->ring));
}

/* The Python side's calls that post or change what the C queue owns: under the queue's mutex when a poll group's
 * thread polls it. */
#define NQ_LOCKED_METHOD(name, impl)                                                                          \
    static PyObject *name(NativeQueue *self, PyObject *args)                                                  \
    {                                                                                                         \
        nq_lock(self);                                                                                        \
        PyObject *res = impl(self, args);                                                                     \
        nq_unlock(self);                                                                                      \
        return res;                                                                                           \
    }

NQ_LOCKED_METHOD(NativeQueue_enable_files, nq_enable_files_py)
NQ_LOCKED_METHOD(NativeQueue_post_read, nq_post_read)
NQ_LOCKED_METHOD(NativeQueue_post_response, nq_post_response)

static PyObject *NativeQueue_flush(NativeQueue *self, PyObject *noargs)
{
    struct nq_queue *q = &self->nq;
    nq_lock(self);
    if (!q->in_poll && q->state != NQ_Q_STOPPED)
        nq_flush(q);
    nq_unlock(self);
    Py_RETURN_NONE;
}

/* set_view(ready, max_transfer, namespaces, sq_entries=0, sq_head=0, sqflow_disabled=False): the one call that
 * changes what the queue serves natively.  namespaces: (nsid, backend entry name (csrc/backend.c: "ram", "null",
 * "file"), lbads, num_blocks, addr, lkey, generation, owner, reference, paused[, file]) each (csrc/nq_view.c);
 * owner is kept alive while the view is.  Returns the outgoing view's figures:
 * {nsid: (reads, writes, flushes, bytes_read, bytes_written, read_latency, write_latency)}, a latency being
 * (sum_ns, ((bucket, count), ...)) with engine/latency.py's buckets. */
static PyObject *NativeQueue_set_view(NativeQueue *self, PyObject *args, PyObject *kwds)
{
    struct nq_queue *q = &self->nq;
    static char *kwlist[] = {"ready", "max_transfer", "namespaces", "sq_entries", "sq_head", "sqflow_disabled", NULL};
    int ready, sqflow_disabled = 0;
    unsigned int max_transfer, sq_entries = 0, sq_head = 0;
    PyObject *list;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "pIO|IIp", kwlist, &ready, &max_transfer, &list, &sq_entries,
                                     &sq_head, &sqflow_disabled))
        return NULL;
    struct nq_view *view = nq_view_build(q, ready, max_transfer, list);
    if (!view)
        return NULL;
    if (ready && !sqflow_disabled && !sq_entries) {
        PyErr_SetString(PyExc_ValueError, "a ready view needs sq_entries (the SQ size, for SQHD)");
        nq_view_free(view);
        return NULL;
    }
    nq_lock(self);
    PyObject *stats = nq_drain_stats(q->view);
    if (!stats) {
        nq_unlock(self);
        nq_view_free(view);
        return NULL;
    }
    for (int i = 0; i < view->count; i++) { /* a staged backend's completions are reaped by every poll from now on */
        int rc = (view->ns[i].ops->flags & NQ_BE_STAGED) ? nq_staged_add(q, view->ns[i].ops) : 0;
        if (rc < 0) {
            nq_unlock(self);
            Py_DECREF(stats);
            nq_view_free(view);
            if (rc == -ENOSPC)
                PyErr_SetString(PyExc_ValueError, "more staged backends in one view than a queue serves (NQ_STAGED_MAX)");
            else
                PyErr_Format(PyExc_OSError, "the %s entry cannot join the queue: %s", view->ns[i].ops->name,
                             strerror(-rc));
            return NULL;
        }
    }
    struct nq_view *old = q->view;
    q->view = view;
    q->view_seq++;
    if (ready && !q->sqhd_on) { /* from here on the C queue numbers every CQE, the Python side's too */
        q->sqhd_on = 1;
        q->sqflow_disabled = sqflow_disabled;
        q->sq_entries = (uint16_t)(sq_entries ? sq_entries : 1);
        q->sqhd = (uint16_t)sq_head;
    }
    nq_unlock(self);
    /* A namespace's memory changes only once its commands drained (the engine's pause): no command uses memory
     * the outgoing view alone lists.  Its owners are released here, outside the mutex (a release may run Python
     * code). */
    nq_view_free(old);
    return stats;
}

/* in_flight() -> {generation: commands}: the native commands in flight per namespace generation, from taking a
 * slot to their response's completion, or to the core's taking it over (a handed-back command mailed by a poll
 * group's thread counts until the loop drains it).  What the engine's pause waits for before a namespace
 * changes (engine/api.py). */
static PyObject *NativeQueue_in_flight(NativeQueue *self, PyObject *noargs)
{
    struct nq_queue *q = &self->nq;
    PyObject *out = PyDict_New();
    if (!out)
        return NULL;
    nq_lock(self);
    for (uint32_t i = 0; i < q->nreqs && q->state < NQ_Q_CLOSED; i++) {
        const struct nq_req *r = &q->reqs[i];
        if (r->state == NQ_FREE)
            continue;
        PyObject *key = PyLong_FromUnsignedLongLong(r->ns_gen);
        PyObject *was = key ? PyDict_GetItemWithError(out, key) : NULL;
        PyObject *now = key && !PyErr_Occurred() ? PyLong_FromLong(was ? PyLong_AsLong(was) + 1 : 1) : NULL;
        int rc = now ? PyDict_SetItem(out, key, now) : -1;
        Py_XDECREF(key);
        Py_XDECREF(now);
        if (rc < 0) {
            nq_unlock(self);
            Py_DECREF(out);
            return NULL;
        }
    }
    nq_unlock(self);
    return out;
}

/* holding(ref) -> the commands holding namespace reference `ref` (a _native.Ref): a fence's bound tears the queue
 * down when it has some (engine/fencing.py); a closed queue's until its QP is gone and its slots let go. */
static PyObject *NativeQueue_holding(NativeQueue *self, PyObject *arg)
{
    struct nq_ref *ref = native_ref_of(arg);
    if (!ref)
        return NULL;
    nq_lock(self);
    uint32_t n = nq_holding(&self->nq, ref);
    nq_unlock(self);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *NativeQueue_take_stats(NativeQueue *self, PyObject *noargs)
{
    struct nq_queue *q = &self->nq;
    nq_lock(self);
    PyObject *res = nq_drain_stats(q->view);
    nq_unlock(self);
    return res;
}

static PyObject *NativeQueue_stats(NativeQueue *self, PyObject *noargs)
{
    struct nq_queue *q = &self->nq;
    nq_lock(self);
    uint32_t busy = q->nreqs - q->nfree;
    PyObject *res = Py_BuildValue("{sKsKsKsKsKsIsIsIsIsisIsIsIsKsKsKsisIsIsIsKsKsKsKsKsK}",
                                  "native_commands", q->native_commands,
                                  "python_commands", q->python_commands, "doorbells", q->doorbells,
                                  "recv_doorbells", q->recv_doorbells, "polls", q->polls, "native_in_flight", busy,
                                  "native_send_free", q->native_slots, "reads_free", q->reads_free,
                                  "send_queue_used", q->sq_count, "failed", q->fail_status,
                                  "ring_in_flight", q->ring ? nr_uring_in_flight(q->ring) : 0u,
                                  "ring_most_in_flight", q->ring_most_in_flight, "ring_queued", q->ring_queued,
                                  "file_commands", q->file_ios, "file_handed_back", q->file_handed_back,
                                  "ring_submits", q->ring_submits, "threaded", q->threaded,
                                  "mailed", q->threaded ? q->mail.count : 0, "bounce_chunks", q->nchunks,
                                  "bounce_chunks_free", q->nchunks_free, "chunk_waits", q->chunk_waits,
                                  "spin_hits", q->spin_hits, "spin_yields", q->spin_yields, "arms", q->arms,
                                  "arm_catches", q->arm_catches, "flushed", q->flushed);
    nq_unlock(self);
    return res;
}

static PyObject *NativeQueue_close(NativeQueue *self, PyObject *noargs)
{
    struct nq_queue *q = &self->nq;
    /* Call after the QP is destroyed (or in error; a poll group's queue after the group let it go): nothing is
     * posted from here on; the view is released.  Never waits for the ring: returns its commands still in the
     * kernel (reap_closed() until 0; the bounce chunks are the kernel's until then). */
    nq_lock(self);
    if (q->state < NQ_Q_CLOSED)
        nq_qmove(&q->state, NQ_Q_CLOSED, q->qid);
    unsigned held = nq_closed_reap(q);
    if (!held && q->state == NQ_Q_CLOSED)
        nq_qmove(&q->state, NQ_Q_RELEASED, q->qid);
    struct nq_view *old = q->view;
    q->view = NULL;
    q->nbatch = q->nbatch_resp = q->nrepost = 0;
    nq_unlock(self);
    nq_view_free(old);
    return PyLong_FromUnsignedLong(held);
}

/* reap_flushed(spin_us=2000) -> the send work requests not seen: after the owner put the QP in the error state
 * (rdma_disconnect) and before it destroys it, the flushed completions taken off the CQs (nq_reap_flushed). */
static PyObject *NativeQueue_reap_flushed(NativeQueue *self, PyObject *args)
{
    double spin_us = 2000.0;
    if (!PyArg_ParseTuple(args, "|d", &spin_us))
        return NULL;
    struct nq_queue *q = &self->nq;
    if (q->threaded && q->state < NQ_Q_STOPPED) {
        PyErr_SetString(PyExc_RuntimeError, "the queue's poll group still polls it: remove it first");
        return NULL;
    }
    nq_lock(self);
    uint32_t left = nq_reap_flushed(q, spin_us > 0 ? (uint64_t)(spin_us * 1000.0) : 0);
    nq_unlock(self);
    return PyLong_FromUnsignedLong(left);
}

/* reap_closed() -> the commands still in the kernel: a closed queue's ring reaped without waiting (on its
 * eventfd), freed when none is left. */
static PyObject *NativeQueue_reap_closed(NativeQueue *self, PyObject *noargs)
{
    struct nq_queue *q = &self->nq;
    nq_lock(self);
    unsigned held = q->state >= NQ_Q_CLOSED ? nq_closed_reap(q) : 0;
    if (!held && q->state == NQ_Q_CLOSED)
        nq_qmove(&q->state, NQ_Q_RELEASED, q->qid);
    nq_unlock(self);
    return PyLong_FromUnsignedLong(held);
}

/* begin_close() -> True while what is posted still has to complete: the responses this poll made (a Disconnect's
 * own among them) are posted now, even inside the poll, and the queue takes no new command from here on; the
 * owner keeps the QP until close_ready, then closes it (nvmet answers the Disconnect, then tears down). */
static PyObject *NativeQueue_begin_close(NativeQueue *self, PyObject *noargs)
{
    struct nq_queue *q = &self->nq;
    nq_lock(self);
    int busy = nq_begin_close(q);
    nq_unlock(self);
    return PyBool_FromLong(busy);
}

static PyObject *NativeQueue_close_ready(NativeQueue *self, void *closure)
{
    struct nq_queue *q = &self->nq;
    nq_lock(self);
    int ready = nq_close_ready(q);
    nq_unlock(self);
    return PyBool_FromLong(ready);
}

/* state -> the queue's lifetime state's name (csrc/nq_life.h): "SERVING" ... "RELEASED" */
static PyObject *NativeQueue_state(NativeQueue *self, void *closure)
{
    struct nq_queue *q = &self->nq;
    nq_lock(self);
    int state = q->state;
    nq_unlock(self);
    return PyUnicode_FromString((unsigned)state < NQ_QSTATES ? nq_qstate_names[state] : "?");
}

static PyObject *NativeQueue_closed(NativeQueue *self, void *closure)
{
    struct nq_queue *q = &self->nq;
    nq_lock(self);
    int closed = q->state >= NQ_Q_CLOSED || q->fail_status;
    nq_unlock(self);
    return PyBool_FromLong(closed);
}

static PyObject *NativeQueue_mail_fd(NativeQueue *self, void *closure)
{
    struct nq_queue *q = &self->nq;
    return PyLong_FromLong(q->threaded ? q->mail.fd : -1);
}

NT_QUEUE_METHODS(NativeQueue, nq.trace, q->nq.qp->qp_num, nq_lock, nq_unlock)

static PyMethodDef NativeQueue_methods[] = {
    {"poll", (PyCFunction)(void (*)(void))NativeQueue_poll, METH_FASTCALL,
     "poll(budget=256) -> completions handled; receives re-posted and sends posted once at the end."},
    {"arm", (PyCFunction)NativeQueue_arm, METH_NOARGS, "Request a completion event on the CQs."},
    {"poll_adaptive", (PyCFunction)(void (*)(void))NativeQueue_poll_adaptive, METH_FASTCALL,
     "poll_adaptive(budget, spin_us) -> (handled, armed): poll, spin up to spin_us after the last completion, "
     "arm the CQs and poll once more (--poll adaptive)."},
    {"post_read", (PyCFunction)NativeQueue_post_read, METH_VARARGS,
     "post_read(tag, local_addr, lkey, length, remote_addr, rkey): an RDMA READ for the Python side."},
    {"post_response", (PyCFunction)NativeQueue_post_response, METH_VARARGS,
     "post_response(tag, cqe, signaled, data_addr, lkey, length, remote_addr, rkey, invalidate)."},
    {"flush", (PyCFunction)NativeQueue_flush, METH_NOARGS, "Post what is queued (a no-op inside a poll)."},
    {"enable_files", (PyCFunction)NativeQueue_enable_files, METH_VARARGS,
     "enable_files(bounce, chunk) -> eventfd of the queue's io_uring (file and block namespaces in the view)."},
    {"set_view", (PyCFunction)(void (*)(void))NativeQueue_set_view, METH_VARARGS | METH_KEYWORDS,
     "set_view(ready, max_transfer, namespaces, sq_entries=0, sq_head=0, sqflow_disabled=False) -> "
     "old figures."},
    {"in_flight", (PyCFunction)NativeQueue_in_flight, METH_NOARGS,
     "in_flight() -> {generation: commands}: native commands in flight per namespace generation."},
    {"holding", (PyCFunction)NativeQueue_holding, METH_O,
     "holding(ref) -> the commands holding namespace reference `ref` (a _native.Ref)."},
    {"take_stats", (PyCFunction)NativeQueue_take_stats, METH_NOARGS,
     "{nsid: (reads, writes, flushes, bytes_read, bytes_written, read_latency, write_latency)} since the last "
     "call; zeroed.  A latency: (sum_ns, ((bucket, count), ...)), buckets as engine/latency.py."},
    {"stats", (PyCFunction)NativeQueue_stats, METH_NOARGS, "The queue's counters."},
    {"close", (PyCFunction)NativeQueue_close, METH_NOARGS,
     "Stop posting (after the QP is gone); never waits: the ring's commands still in the kernel, cancelled where "
     "they can be."},
    {"reap_flushed", (PyCFunction)NativeQueue_reap_flushed, METH_VARARGS,
     "reap_flushed(spin_us=2000) -> send work requests not seen: after the QP was put in the error state, what it "
     "flushed taken off the CQs (the queue failed, nothing delivered), before the owner destroys the QP."},
    {"reap_closed", (PyCFunction)NativeQueue_reap_closed, METH_NOARGS,
     "A closed queue's ring reaped without waiting: the commands still in the kernel (the ring freed at 0)."},
    {"begin_close", (PyCFunction)NativeQueue_begin_close, METH_NOARGS,
     "begin_close() -> True while responses already made are still to leave: posted now, no new command taken."},
    {"drain", (PyCFunction)NativeQueue_drain, METH_NOARGS,
     "A poll group's queue: deliver what its thread mailed (capsules, send completions, a failure); how many."},
    NT_QUEUE_METHOD_DEFS(NativeQueue)
    {NULL, NULL, 0, NULL},
};

static PyObject *NativeQueue_ring_unsubmitted(NativeQueue *self, void *closure)
{
    struct nq_queue *q = &self->nq;
    return PyBool_FromLong(q->ring_queued != 0);
}

static PyGetSetDef NativeQueue_getset[] = {
    {"closed", (getter)NativeQueue_closed, NULL, "closed, or a work completion failed", NULL},
    {"state", (getter)NativeQueue_state, NULL, "the lifetime state (csrc/nq_life.h): SERVING ... RELEASED", NULL},
    {"close_ready", (getter)NativeQueue_close_ready, NULL,
     "after begin_close: everything posted has completed (or the queue failed): the owner may close the QP", NULL},
    {"ring_unsubmitted", (getter)NativeQueue_ring_unsubmitted, NULL,
     "commands wait on the ring for a submission that failed (the kernel short of memory): poll again", NULL},
    {"mail_fd", (getter)NativeQueue_mail_fd, NULL, "a poll group's queue: its mailbox eventfd (else -1)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NativeQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nvmeof_roce._native.Queue",
    .tp_basicsize = sizeof(NativeQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One NVMe/RDMA I/O queue's data path in C (docs/native.md).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)NativeQueue_init,
    .tp_dealloc = (destructor)NativeQueue_dealloc,
    .tp_methods = NativeQueue_methods,
    .tp_getset = NativeQueue_getset,
};

/* latency_bucket(ns): the bucket a command of this latency lands in, for the tests that hold it to
 * engine/latency.py's LatencyHistogram.record_ns. */
static PyObject *nq_latency_bucket_py(PyObject *module, PyObject *arg)
{
    unsigned long long ns = PyLong_AsUnsignedLongLong(arg);
    if (ns == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLong(nq_latency_bucket(ns));
}

static PyMethodDef nq_module_functions[] = {
    {"latency_bucket", nq_latency_bucket_py, METH_O,
     "latency_bucket(ns) -> the latency histogram bucket of the native data path (engine/latency.py's buckets)."},
    {NULL, NULL, 0, NULL},
};

int native_cm_register(PyObject *module); /* csrc/cm.c: the verbs objects of a native queue */
int native_file_register(PyObject *module); /* csrc/nq_file.c: _native.File */

int native_queue_register(PyObject *module)
{
    if (native_cm_register(module) < 0)
        return -1;
    if (PyType_Ready(&NativeQueueType) < 0 || native_file_register(module) < 0)
        return -1;
    nq_lat_init();
    if (PyModule_AddFunctions(module, nq_module_functions) < 0)
        return -1;
    Py_INCREF(&NativeQueueType);
    if (PyModule_AddObject(module, "Queue", (PyObject *)&NativeQueueType) < 0) {
        Py_DECREF(&NativeQueueType);
        return -1;
    }
    return PyModule_AddIntConstant(module, "SIGNAL_EVERY", NQ_SIGNAL_EVERY) < 0 ||
           PyModule_AddIntConstant(module, "POLL_BATCH", NQ_POLL_BATCH) < 0 ||
           PyModule_AddIntConstant(module, "LATENCY_BUCKETS", NQ_LAT_BUCKETS) < 0 ? -1 : 0;
}
