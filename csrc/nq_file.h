/* `_native.File` (csrc/nq_file.c) as the native queue's type (csrc/nq_type.c) sees it. */
#ifndef NQ_FILE_H
#define NQ_FILE_H

#include "native.h"

struct nq_file;

/* Whether `obj` is a _native.File; then native_file_of gives its struct nq_file (NULL if it was not initialised). */
int native_file_check(PyObject *obj);
struct nq_file *native_file_of(PyObject *obj);
/* The type, for a staged backend's handle that extends it (csrc/nq_rbd.c: `_native.RbdImage`). */
PyTypeObject *native_file_type(void);
/* PyType_Ready and the module's "File". */
int native_file_register(PyObject *module);

#endif
