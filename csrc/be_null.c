/* The null backend's C entry (csrc/backend.h; Python: engine/backends/null.py): in place.  Reads are sent from the
 * queue's zeroed registered buffer, writes land in its sink buffer; Flush, Write Zeroes and deallocate have
 * nothing to do. */
#include "backend.h"
#include "nq_hot.h"

static int null_read(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    if (r->len > q->zero_len)
        return NQ_BE_CORE;
    r->local = q->zero_base;
    r->lkey = q->zero_lkey;
    return NQ_BE_DONE;
}

static int null_write(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    if (r->len > q->sink_len)
        return NQ_BE_CORE;
    r->local = q->sink_base;
    r->lkey = q->sink_lkey;
    return NQ_BE_DONE;
}

static int null_nothing(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    return NQ_BE_DONE;
}

const struct nq_backend_ops nq_backend_null = {
    .name = "null",
    .flags = NQ_BE_IN_PLACE,
    .submit_read = null_read,
    .submit_write = null_write,
    .flush = null_nothing,
    .write_zeroes = null_nothing,
    .discard = null_nothing,
};
