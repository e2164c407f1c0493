/* Per-queue RDMA data path: receive ring, request slots, RDMA READ/WRITE and response SEND. */
#include "native.h"

int native_queue_register(PyObject *module)
{
    return 0;
}
