/* io_uring engine for file and block namespaces. */
#include "native.h"

int native_uring_register(PyObject *module)
{
    return 0;
}
