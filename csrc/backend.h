/* The backend seam of the native data path: one ops table per backend kind, which the C queue (csrc/nq_hot.c) calls
 * per namespace.  The C twin of engine/backends/base.py's contract (docs/architecture.md "The backend seam").
 *
 * A namespace in a queue's view names its entry (`nq_ns.ops`, found by name in the registry, csrc/backend.c
 * `nq_backends[]`, when the view is set).  Two shapes:
 *
 * - in place (NQ_BE_IN_PLACE: RAM, null): the data moves between the host and the backend's memory by RDMA.
 *   submit_read sets where a Read's data is sent from (r->local, r->lkey), submit_write where a Write's data lands
 *   (the RDMA READ, or the copy of in-capsule data, is the write); each answers NQ_BE_DONE, or NQ_BE_CORE when the
 *   core must serve the command.
 * - staged (NQ_BE_STAGED: file and block through io_uring, RBD through librbd's aio): the data goes through one of the queue's
 *   bounce chunks (r->local, r->lkey set by the queue).  submit_read is called when the chunk is taken,
 *   submit_write once the data is in it; each answers NQ_BE_STARTED (its completion comes later), NQ_BE_WAIT (no
 *   room now: the queue retries it in arrival order after a completion) or NQ_BE_CORE.  Completions are delivered
 *   to the queue's poll: `reap` takes what the device finished (an io_uring's completion queue; librbd's callbacks
 *   push to the entry's per-queue ring and write the queue's ring eventfd, csrc/be_rbd.c) and calls
 *   nq_backend_done(q, idx, res) for each, res the bytes moved or -errno (anything but the command's length hands
 *   it to the core, which does it again and words the error), or nq_backend_answer(q, idx, status) for an error
 *   the entry answers itself (RBD's path errors); `submit` hands what was queued in this poll to the device, once
 *   per poll, and says how many it started (the poll then reaps once more); `fd` is the descriptor the event
 *   loop watches for completions.  A staged entry with per-queue state has `attach` (made when its first
 *   namespace enters the queue's view: no allocation per command) and `closed` (the queue closed: the commands
 *   still on the device, whose completions must not touch the queue; its state let go once none is left, or,
 *   `final`, when the queue itself is freed, by the last completion).
 *
 * An in-place entry with NQ_BE_MEMORY is not called for a Read or a Write: the queue sets r->local = addr + offset
 * and r->lkey itself (RAM).  r->offset, r->op_len and r->ops are set for the commands that go through an entry
 * (nq_capsule_entry), not on that path.
 *
 * flush, write_zeroes (r->offset, r->op_len) and discard (the same range) answer NQ_BE_DONE, NQ_BE_STARTED,
 * NQ_BE_WAIT or NQ_BE_CORE, as above.  Nothing here allocates per command.  A backend's handle on its storage (a
 * descriptor, an image) is the namespace's `nq_file` (csrc/nq_hot.h): reference counted by the view and by every
 * command between taking its slot and its completion.
 *
 * A new backend: its file (csrc/be_<kind>.c, defining `const struct nq_backend_ops nq_backend_<kind>`) and its
 * entry in nq_backends[] (csrc/backend.c); nothing in the queue names a kind. */
#ifndef NVMEOF_ROCE_BACKEND_H
#define NVMEOF_ROCE_BACKEND_H

#include <stdint.h>

struct nq_queue;
struct nq_ns;
struct nq_req;

enum nq_be_result {
    NQ_BE_DONE = 0,    /* done now: the queue moves the data (in place) or answers */
    NQ_BE_STARTED = 1, /* on the device: nq_backend_done from `reap` finishes it */
    NQ_BE_WAIT = 2,    /* no room now (its namespace's depth): retried after a completion */
    NQ_BE_CORE = 3,    /* the core serves it (nothing was started) */
};

#define NQ_BE_IN_PLACE 0x1u   /* the device reads and writes the backend's memory (submit_* set r->local) */
#define NQ_BE_STAGED 0x2u     /* through the queue's bounce chunks, completed by reap */
#define NQ_BE_NEEDS_ADDR 0x4u /* the view gives its registered memory (addr, lkey) */
#define NQ_BE_NEEDS_FILE 0x8u /* the view gives its handle (a _native.File) */
/* in place, and the namespace is its registered memory (NQ_BE_NEEDS_ADDR: addr, lkey): a Read is sent from, and a
 * Write lands at, addr + offset.  The queue computes that itself on its hot path instead of calling submit_read /
 * submit_write (which say the same, for a caller off that path): a 4 KiB I/O's budget has no room for an indirect
 * call (docs/native.md "Backends: one ops table per kind"). */
#define NQ_BE_MEMORY 0x10u

typedef int (*nq_be_op)(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx);

struct nq_backend_ops {
    const char *name; /* as the view names it (engine/backends: Backend.native) */
    unsigned flags;
    nq_be_op submit_read;
    nq_be_op submit_write;
    nq_be_op flush;
    nq_be_op write_zeroes;
    nq_be_op discard;
    int (*reap)(struct nq_queue *q);       /* staged: completions to nq_backend_done; the number */
    int (*submit)(struct nq_queue *q);     /* staged: what this poll queued, to the device; 0 if nothing was */
    int (*fd)(struct nq_queue *q);         /* staged: the descriptor the loop watches, -1 if none */
    int (*attach)(struct nq_queue *q, void **state);              /* staged, optional: 0 or -errno */
    unsigned (*closed)(struct nq_queue *q, void **state, int final); /* staged, optional: commands still out */
};

/* The entry named `name` (csrc/backend.c), or NULL. */
const struct nq_backend_ops *nq_backend_find(const char *name);
/* The names of every entry, for an error message: "ram, null, uring". */
const char *nq_backend_names(void);

/* csrc/nq_hot.c: a staged backend's command `idx` finished with `res` (bytes, 0 for flush/zeroes/discard, or
 * -errno). */
void nq_backend_done(struct nq_queue *q, uint32_t idx, int res);
/* csrc/nq_hot.c: a staged backend's command `idx` finished with an NVMe status the entry chose (a path error,
 * without DNR: csrc/be_rbd.c's ETIMEDOUT and ESHUTDOWN, as engine/io.py device_status): answered with it. */
void nq_backend_answer(struct nq_queue *q, uint32_t idx, uint16_t status);

#endif
