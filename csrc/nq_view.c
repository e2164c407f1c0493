/* A native queue's view (struct nq_view, csrc/nq_hot.h) on the Python side of csrc/nq_type.c: built from
 * set_view's namespaces, freed, and its per-namespace figures drained.  docs/native.md. */
#include "native.h"
#include "nq_file.h"
#include "nq_hot.h"
#include "nq_view.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void nq_view_free(struct nq_view *view)
{
    if (!view)
        return;
    Py_XDECREF((PyObject *)view->keep);
    for (int i = 0; view->ns && i < view->count; i++)
        if (view->ns[i].ref)
            nq_ref_unhold(view->ns[i].ref);
    PyMem_Free(view->ns);
    PyMem_Free(view);
}

/* (sum_ns, ((bucket, count), ...)) of one histogram's non-empty buckets, zeroed; buckets as engine/latency.py. */
static PyObject *nq_drain_latency(struct nq_ns *ns, int kind)
{
    Py_ssize_t used = 0;
    for (int i = 0; i < NQ_LAT_BUCKETS; i++)
        used += ns->lat[kind][i] != 0;
    PyObject *buckets = PyTuple_New(used);
    if (!buckets)
        return NULL;
    Py_ssize_t at = 0;
    for (int i = 0; i < NQ_LAT_BUCKETS; i++) {
        if (!ns->lat[kind][i])
            continue;
        PyObject *pair = Py_BuildValue("(iK)", i, (unsigned long long)ns->lat[kind][i]);
        if (!pair) {
            Py_DECREF(buckets);
            return NULL;
        }
        PyTuple_SET_ITEM(buckets, at++, pair);
    }
    PyObject *out = Py_BuildValue("(KN)", (unsigned long long)ns->lat_sum_ns[kind], buckets);
    if (out) {
        memset(ns->lat[kind], 0, sizeof ns->lat[kind]);
        ns->lat_sum_ns[kind] = 0;
    }
    return out;
}

PyObject *nq_drain_stats(struct nq_view *view)
{
    PyObject *out = PyDict_New();
    if (!out || !view)
        return out;
    for (int i = 0; i < view->count; i++) {
        struct nq_ns *ns = &view->ns[i];
        PyObject *key = PyLong_FromUnsignedLong(ns->nsid);
        PyObject *read_lat = nq_drain_latency(ns, NQ_LAT_READ), *write_lat = nq_drain_latency(ns, NQ_LAT_WRITE);
        PyObject *val = read_lat && write_lat ? Py_BuildValue("(KKKKKOO)", ns->reads, ns->writes, ns->flushes,
                                                              ns->bytes_read, ns->bytes_written, read_lat,
                                                              write_lat) : NULL;
        Py_XDECREF(read_lat);
        Py_XDECREF(write_lat);
        if (!key || !val || PyDict_SetItem(out, key, val) < 0) {
            Py_XDECREF(key);
            Py_XDECREF(val);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(val);
        ns->reads = ns->writes = ns->flushes = ns->bytes_read = ns->bytes_written = 0;
    }
    return out;
}

static int nq_ns_cmp(const void *a, const void *b)
{
    uint32_t x = ((const struct nq_ns *)a)->nsid, y = ((const struct nq_ns *)b)->nsid;
    return x < y ? -1 : x > y;
}

/* set_view's namespaces as a new view (csrc/nq_type.c installs it), checked and sorted by nsid; NULL with a
 * Python error. */
struct nq_view *nq_view_build(struct nq_queue *q, int ready, unsigned int max_transfer, PyObject *list)
{
    PyObject *seq = PySequence_Fast(list, "namespaces must be a sequence of tuples");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    struct nq_view *view = PyMem_Calloc(1, sizeof *view);
    if (!view || !(view->ns = PyMem_Calloc(n ? n : 1, sizeof *view->ns)) || !(view->keep = PyTuple_New(n))) {
        Py_DECREF(seq);
        nq_view_free(view);
        return (struct nq_view *)PyErr_NoMemory();
    }
    view->ready = ready;
    view->max_transfer = max_transfer;
    view->count = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        struct nq_ns *ns = &view->ns[i];
        const char *kind;
        unsigned int nsid, lbads, lkey;
        unsigned long long num_blocks, addr, gen;
        PyObject *owner, *ref, *file = Py_None;
        int paused;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "IsIKKIKOOp|O;namespace (nsid, kind, lbads, "
                              "num_blocks, addr, lkey, generation, owner, reference, paused[, file])", &nsid, &kind,
                              &lbads, &num_blocks, &addr, &lkey, &gen, &owner, &ref, &paused, &file))
            goto bad;
        ns->paused = (uint8_t)paused;
        ns->ref = native_ref_of(ref); /* held by the view from here (nq_view_free lets it go) */
        if (!ns->ref)
            goto bad;
        nq_ref_hold(ns->ref);
        ns->ops = nq_backend_find(kind); /* its backend's entry (csrc/backend.c) */
        if (!ns->ops) {
            PyErr_Format(PyExc_ValueError, "namespace %u: kind %s is served by Python, not the native view (its "
                         "entries, csrc/backend.c: %s)", nsid, kind, nq_backend_names());
            goto bad;
        }
        ns->be_flags = (uint8_t)ns->ops->flags;
        if (ns->ops->flags & NQ_BE_NEEDS_FILE) {
            if (!native_file_check(file)) {
                PyErr_Format(PyExc_ValueError, "namespace %u: a %s namespace needs its _native.File", nsid, kind);
                goto bad;
            }
            if (!q->ring || max_transfer > q->bounce_chunk) {
                PyErr_Format(PyExc_ValueError, "namespace %u: file namespaces need enable_files() first, with "
                             "bounce chunks of max_transfer (%u) bytes", nsid, max_transfer);
                goto bad;
            }
            ns->file = native_file_of(file);
            owner = file; /* the File keeps the descriptor: it lives as long as the view */
        }
        if (lbads < 9 || lbads > 16 || !nsid || ((ns->ops->flags & NQ_BE_NEEDS_ADDR) && !addr)) {
            PyErr_Format(PyExc_ValueError, "namespace %u: lbads %u (9..16) and a RAM namespace's address", nsid,
                         lbads);
            goto bad;
        }
        ns->nsid = nsid;
        ns->lbads = (uint8_t)lbads;
        ns->num_blocks = num_blocks;
        ns->base = (char *)(uintptr_t)addr;
        ns->lkey = lkey;
        ns->gen = gen;
        Py_INCREF(owner);
        PyTuple_SET_ITEM(view->keep, i, owner);
    }
    Py_DECREF(seq);
    qsort(view->ns, n, sizeof *view->ns, nq_ns_cmp);
    for (Py_ssize_t i = 1; i < n; i++)
        if (view->ns[i].nsid == view->ns[i - 1].nsid) {
            PyErr_Format(PyExc_ValueError, "namespace %u appears twice in the view", view->ns[i].nsid);
            nq_view_free(view);
            return NULL;
        }
    return view;
bad:
    Py_DECREF(seq);
    nq_view_free(view);
    return NULL;
}
