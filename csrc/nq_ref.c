/* The CPython type `_native.Ref`: a namespace epoch's reference (csrc/nq_ref.h) as the engine sees it
 * (engine/subsystem.py "references"): `take()` and `put()` for the commands of the Python data path, `count` for the fences.
 */
#include "native.h"
#include "nq_ref.h"

typedef struct {
    PyObject_HEAD
    struct nq_ref *ref;
} NativeRef;

static PyObject *NativeRef_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Ref() takes no arguments");
        return NULL;
    }
    NativeRef *self = (NativeRef *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    self->ref = calloc(1, sizeof *self->ref); /* freed with its last holder or command (nq_ref_drop) */
    if (!self->ref) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->ref->word = NQ_REF_HOLDER; /* this object's */
    return (PyObject *)self;
}

static void NativeRef_dealloc(NativeRef *self)
{
    if (self->ref)
        nq_ref_unhold(self->ref);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *NativeRef_take(NativeRef *self, PyObject *noargs)
{
    nq_ref_take(self->ref);
    Py_RETURN_NONE;
}

static PyObject *NativeRef_put(NativeRef *self, PyObject *noargs)
{
    if (!nq_ref_commands(self->ref)) {
        PyErr_SetString(PyExc_RuntimeError, "a namespace reference was let go more often than it was taken");
        return NULL;
    }
    nq_ref_put(self->ref); /* never the last: this object holds it */
    Py_RETURN_NONE;
}

static PyObject *NativeRef_count(NativeRef *self, void *closure)
{
    return PyLong_FromUnsignedLong(nq_ref_commands(self->ref));
}

static PyMethodDef NativeRef_methods[] = {
    {"take", (PyCFunction)NativeRef_take, METH_NOARGS, "A command of the Python data path takes it."},
    {"put", (PyCFunction)NativeRef_put, METH_NOARGS, "A command of the Python data path lets it go."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef NativeRef_getset[] = {
    {"count", (getter)NativeRef_count, NULL, "Commands holding it now, on both data paths.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NativeRefType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nvmeof_roce._native.Ref",
    .tp_basicsize = sizeof(NativeRef),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A namespace epoch's reference: the commands in flight on it (docs/native.md).",
    .tp_new = NativeRef_new,
    .tp_dealloc = (destructor)NativeRef_dealloc,
    .tp_methods = NativeRef_methods,
    .tp_getset = NativeRef_getset,
};

struct nq_ref *native_ref_of(PyObject *obj)
{
    if (!PyObject_TypeCheck(obj, &NativeRefType)) {
        PyErr_Format(PyExc_TypeError, "a namespace's reference must be a _native.Ref, not %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    return ((NativeRef *)obj)->ref;
}

int native_ref_register(PyObject *module)
{
    if (PyType_Ready(&NativeRefType) < 0)
        return -1;
    Py_INCREF(&NativeRefType);
    if (PyModule_AddObject(module, "Ref", (PyObject *)&NativeRefType) < 0) {
        Py_DECREF(&NativeRefType);
        return -1;
    }
    return 0;
}
