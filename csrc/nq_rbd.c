/* The CPython type `_native.RbdImage`: an RBD namespace's handle for the native view, a `_native.File` whose
 * struct nq_file is csrc/be_rbd.c's (its own RADOS client and image, opened in C through the dlopen'd librbd;
 * engine/backends/rbd.py `native_handle` makes it with the namespace's settings). */
#include "native.h"
#include "be_rbd.h"
#include "nq_file.h"
#include "nq_hot.h"

#include <errno.h>

typedef struct { /* the same layout as _native.File's (csrc/nq_file.c): its methods and dealloc serve this too */
    PyObject_HEAD
    struct nq_file *file;
} NativeRbd;

/* RbdImage(librados, librbd, conf, name, pool, namespace, image, options, depth): options a sequence of (key,
 * value) strings for rados_conf_set (the client's cache and timeouts).  OSError (errno, what failed) if it
 * cannot open; the cluster is waited for without the GIL. */
static int NativeRbd_init(NativeRbd *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"librados", "librbd", "conf", "name", "pool", "namespace", "image", "options", "depth",
                             NULL};
    struct nq_rbd_params p = {0};
    PyObject *options;
    unsigned int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "sszssssOI", kwlist, &p.librados, &p.librbd, &p.conf, &p.name,
                                     &p.pool, &p.ns, &p.image, &options, &depth))
        return -1;
    if (self->file) {
        PyErr_SetString(PyExc_RuntimeError, "an RbdImage is initialised once");
        return -1;
    }
    if (depth == 0 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "RbdImage: depth %u is not 1..4096", depth);
        return -1;
    }
    PyObject *seq = PySequence_Fast(options, "options must be a sequence of (key, value)");
    if (!seq)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    const char **opts = PyMem_Calloc(2 * n + 2, sizeof *opts);
    if (!opts) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ss;an option is (key, value)", &opts[2 * i],
                              &opts[2 * i + 1])) {
            PyMem_Free(opts);
            Py_DECREF(seq);
            return -1;
        }
    p.options = opts;
    p.depth = depth;
    char err[512] = "";
    struct nq_file *f = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = nq_rbd_open(&p, &f, err, sizeof err);
    Py_END_ALLOW_THREADS
    PyMem_Free(opts);
    Py_DECREF(seq); /* the strings lived as long as it */
    if (rc < 0) {
        PyObject *exc = Py_BuildValue("(is)", -rc, err);
        if (exc) {
            PyErr_SetObject(PyExc_OSError, exc);
            Py_DECREF(exc);
        }
        return -1;
    }
    self->file = f;
    return 0;
}

static PyObject *NativeRbd_size(NativeRbd *self, PyObject *noargs)
{
    return PyLong_FromUnsignedLongLong(self->file ? nq_rbd_size(self->file) : 0);
}

static PyObject *NativeRbd_aio_outstanding(NativeRbd *self, PyObject *noargs)
{
    return PyLong_FromUnsignedLong(self->file ? nq_rbd_aio_outstanding(self->file) : 0);
}

static PyMethodDef NativeRbd_methods[] = {
    {"size", (PyCFunction)NativeRbd_size, METH_NOARGS, "The image's size in bytes (rbd_get_size), 0 if unknown."},
    {"aio_outstanding", (PyCFunction)NativeRbd_aio_outstanding, METH_NOARGS,
     "librbd's calls out on this image, every native queue's."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NativeRbdType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nvmeof_roce._native.RbdImage",
    .tp_basicsize = sizeof(NativeRbd),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An RBD namespace's image, opened in C through librbd, for the native view (docs/rbd.md).",
    .tp_init = (initproc)NativeRbd_init,
    .tp_methods = NativeRbd_methods,
};

int native_rbd_register(PyObject *module)
{
    NativeRbdType.tp_base = native_file_type(); /* new, dealloc and status are File's */
    if (PyType_Ready(&NativeRbdType) < 0)
        return -1;
    Py_INCREF(&NativeRbdType);
    if (PyModule_AddObject(module, "RbdImage", (PyObject *)&NativeRbdType) < 0) {
        Py_DECREF(&NativeRbdType);
        return -1;
    }
    return 0;
}
