/* The RAM backend's C entry (csrc/backend.h; Python: engine/backends/ram.py): in place.  A Read's data is sent by
 * RDMA WRITE straight from the namespace's registered memory, a Write's lands there by RDMA READ (or is copied from
 * the capsule); Flush has nothing to make durable; Write Zeroes and deallocate zero the range (the memory is
 * registered, so its pages are pinned: zeros are written, as RamBackend does once pinned). */
#include "backend.h"
#include "nq_hot.h"

#include <string.h>

/* What the queue computes inline for an NQ_BE_MEMORY entry (csrc/nq_hot.c nq_capsule); here for any other caller. */
static int ram_map(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    r->local = ns->base + r->offset;
    r->lkey = ns->lkey;
    return NQ_BE_DONE;
}

static int ram_flush(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    return NQ_BE_DONE;
}

static int ram_zero(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    memset(ns->base + r->offset, 0, r->op_len);
    return NQ_BE_DONE;
}

const struct nq_backend_ops nq_backend_ram = {
    .name = "ram",
    .flags = NQ_BE_IN_PLACE | NQ_BE_NEEDS_ADDR | NQ_BE_MEMORY,
    .submit_read = ram_map,
    .submit_write = ram_map,
    .flush = ram_flush,
    .write_zeroes = ram_zero,
    .discard = ram_zero,
};
