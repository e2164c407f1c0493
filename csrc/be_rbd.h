/* An RBD namespace's native handle (csrc/be_rbd.c), as its CPython type `_native.RbdImage` (csrc/nq_rbd.c) makes
 * it: librados and librbd loaded with dlopen (so the module imports where Ceph is not installed, and a test can
 * load a fake, tests/unit/fakerbd/), the namespace's own RADOS client and image.  Plain C, no Python. */
#ifndef NVMEOF_ROCE_BE_RBD_H
#define NVMEOF_ROCE_BE_RBD_H

#include <stddef.h>
#include <stdint.h>

struct nq_file;

struct nq_rbd_params {
    const char *librados, *librbd; /* what dlopen loads (ceph/bindings.py: LIBRADOS, LIBRBD) */
    const char *conf;              /* ceph.conf, or NULL: librados's default search */
    const char *name;              /* the client's name: "client.admin" */
    const char *pool, *ns, *image; /* ns: a RADOS namespace, or "" */
    const char *const *options;    /* key, value, key, value, ..., NULL: rados_conf_set after the conf file */
    uint32_t depth;                /* the namespace's depth: its commands on librbd at once, every queue's */
};

/* Open: 0 and *out (one reference, the caller's: nq_file_put lets it go; the image closes with the last one and
 * librbd's last completion), or -errno with what failed in `err`.  Blocks for the cluster (librados's
 * client_mount_timeout): the caller releases the GIL. */
int nq_rbd_open(const struct nq_rbd_params *p, struct nq_file **out, char *err, size_t errlen);
/* The image's size in bytes now (rbd_get_size), or 0 if it cannot say. */
uint64_t nq_rbd_size(struct nq_file *f);
/* librbd's aio calls this handle has outstanding, every queue's. */
uint32_t nq_rbd_aio_outstanding(struct nq_file *f);

#endif
