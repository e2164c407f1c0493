/* The CPython type `_native.File`: a file or block namespace's descriptor and depth, which the native queue's view
 * (csrc/nq_type.c, `_native.Queue.set_view`) hands to the hot path (csrc/nq_hot.c) as its struct nq_file.
 */
#include "native.h"
#include "nq_file.h"
#include "nq_hot.h"

#include <fcntl.h>
#include <stdlib.h>

/* _native.File(fd, depth): a file or block namespace's descriptor for the native view (a dup, closed with the
 * last reference) and its depth; in_flight / most_in_flight are its commands on the queues' rings. */
typedef struct {
    PyObject_HEAD
    struct nq_file *file;
} NativeFile;

static int NativeFile_init(NativeFile *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "depth", NULL};
    int fd;
    unsigned int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iI", kwlist, &fd, &depth))
        return -1;
    if (self->file) {
        PyErr_SetString(PyExc_RuntimeError, "a File is initialised once");
        return -1;
    }
    if (fd < 0 || depth == 0 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "File(fd, depth): fd %d must be open, depth %u 1..4096", fd, depth);
        return -1;
    }
    struct nq_file *f = calloc(1, sizeof *f); /* freed by nq_file_put */
    if (!f) {
        PyErr_NoMemory();
        return -1;
    }
    f->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (f->fd < 0) {
        free(f);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    f->refs = 1;
    f->depth = depth;
    self->file = f;
    return 0;
}

static void NativeFile_dealloc(NativeFile *self)
{
    nq_file_put(self->file);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *NativeFile_status(NativeFile *self, PyObject *noargs)
{
    struct nq_file *f = self->file;
    if (!f)
        return PyDict_New();
    return Py_BuildValue("{sIsIsIsK}", "depth", f->depth, "in_flight", __atomic_load_n(&f->in_flight,
                         __ATOMIC_RELAXED), "most_in_flight", __atomic_load_n(&f->most_in_flight, __ATOMIC_RELAXED),
                         "submitted", (unsigned long long)__atomic_load_n(&f->submitted, __ATOMIC_RELAXED));
}

static PyMethodDef NativeFile_methods[] = {
    {"status", (PyCFunction)NativeFile_status, METH_NOARGS,
     "{depth, in_flight, most_in_flight, submitted}: its commands on the native queues' rings."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NativeFileType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nvmeof_roce._native.File",
    .tp_basicsize = sizeof(NativeFile),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A file or block namespace's descriptor and depth, for the native view (docs/native.md).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)NativeFile_init,
    .tp_dealloc = (destructor)NativeFile_dealloc,
    .tp_methods = NativeFile_methods,
};

int native_file_check(PyObject *obj)
{
    return PyObject_TypeCheck(obj, &NativeFileType);
}

struct nq_file *native_file_of(PyObject *obj)
{
    return ((NativeFile *)obj)->file;
}

PyTypeObject *native_file_type(void)
{
    return &NativeFileType;
}

int native_file_register(PyObject *module)
{
    if (PyType_Ready(&NativeFileType) < 0)
        return -1;
    Py_INCREF(&NativeFileType);
    if (PyModule_AddObject(module, "File", (PyObject *)&NativeFileType) < 0) {
        Py_DECREF(&NativeFileType);
        return -1;
    }
    return 0;
}
