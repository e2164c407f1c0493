/* The native backend registry: every C entry the queue may serve a namespace with (csrc/backend.h), by the name
 * the view gives (engine/backends: Backend.native).  A new backend is one line here and its csrc/be_<kind>.c. */
#include "backend.h"

#include <stddef.h>
#include <string.h>

extern const struct nq_backend_ops nq_backend_ram, nq_backend_null, nq_backend_uring, nq_backend_rbd;

static const struct nq_backend_ops *const nq_backends[] = {
    &nq_backend_ram,
    &nq_backend_null,
    &nq_backend_uring,
    &nq_backend_rbd,
};

#define NQ_BACKENDS (sizeof nq_backends / sizeof nq_backends[0])

const struct nq_backend_ops *nq_backend_find(const char *name)
{
    for (size_t i = 0; i < NQ_BACKENDS; i++)
        if (!strcmp(nq_backends[i]->name, name))
            return nq_backends[i];
    return NULL;
}

const char *nq_backend_names(void)
{
    static char names[256];
    if (!names[0]) {
        size_t at = 0;
        for (size_t i = 0; i < NQ_BACKENDS && at + 2 < sizeof names; i++) {
            const char *n = nq_backends[i]->name;
            size_t len = strlen(n);
            if (at + len + 3 > sizeof names)
                break;
            if (i) {
                memcpy(names + at, ", ", 2);
                at += 2;
            }
            memcpy(names + at, n, len);
            at += len;
        }
        names[at] = 0;
    }
    return names;
}
