/* The module object; every part of the native data path adds itself in its own register function, called from here
 * (not from another part: a part that only serves others, like the poll groups on the queues, stays one-way). */
#include "native.h"

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "nvmeof_roce._native",
    .m_doc = "The native data path of the nvmeof-roce target (docs/native.md).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__native(void)
{
    PyObject *module = PyModule_Create(&native_module);
    if (!module)
        return NULL;
    if (native_queue_register(module) < 0 || native_pollgroup_register(module) < 0 ||
        native_uring_register(module) < 0 || native_hostq_register(module) < 0 ||
        native_cm_channel_register(module) < 0 || native_ref_register(module) < 0 ||
        native_rbd_register(module) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
