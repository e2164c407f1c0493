/* The io_uring backend's C entry (csrc/backend.h; Python: engine/backends/file.py, kinds "file" and "block"):
 * staged.  A Read is read by the queue's ring into its bounce chunk, then sent; a Write's data comes into the chunk,
 * then the ring writes it (RWF_DSYNC with FUA).  A namespace's depth (its io engine depth, nq_file) bounds its
 * commands on every queue's ring.  Every command started in a poll goes to the kernel in one io_uring_enter
 * (`submit`); completions come back through the ring's eventfd (`fd`) and `reap`.  Flush, Write Zeroes and
 * deallocate are the core's (no entry): its fdatasync, fallocate and BLKZEROOUT with their fallbacks, on the
 * namespace's own engine. */
#include "backend.h"
#include "nq_hot.h"

/* Onto the ring when its namespace has room (its depth); submitted at the poll's end. */
static int uring_start(struct nq_queue *q, struct nq_req *r, uint32_t idx, int write)
{
    struct nq_file *f = r->file;
    /* Full: wait for a completion on this queue's ring, which wakes this queue (its eventfd).  A queue with
     * nothing on its ring would wait for other queues' completions, which do not wake it: it starts one anyway,
     * so a namespace has at most depth + (queues - 1) commands on the device. */
    if (__atomic_load_n(&f->in_flight, __ATOMIC_RELAXED) >= f->depth && nr_uring_in_flight(q->ring))
        return NQ_BE_WAIT;
    int rc;
    if (!write)
        rc = nr_uring_read(q->ring, f->fd, r->local, r->len, r->offset, idx);
    else if (r->fua)
        rc = nr_uring_write_fua(q->ring, f->fd, r->local, r->len, r->offset, idx);
    else
        rc = nr_uring_write(q->ring, f->fd, r->local, r->len, r->offset, idx);
    if (rc < 0)
        return NQ_BE_WAIT; /* -EBUSY cannot happen (the ring has a place per slot): wait, as for a full namespace */
    q->ring_queued++;
    __atomic_fetch_add(&f->submitted, 1, __ATOMIC_RELAXED);
    uint32_t now = __atomic_add_fetch(&f->in_flight, 1, __ATOMIC_RELAXED);
    uint32_t most = __atomic_load_n(&f->most_in_flight, __ATOMIC_RELAXED);
    while (now > most && !__atomic_compare_exchange_n(&f->most_in_flight, &most, now, 1, __ATOMIC_RELAXED,
                                                       __ATOMIC_RELAXED))
        ;
    unsigned on_ring = nr_uring_in_flight(q->ring);
    if (on_ring > q->ring_most_in_flight)
        q->ring_most_in_flight = on_ring;
    return NQ_BE_STARTED;
}

static int uring_read(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    return uring_start(q, r, idx, 0);
}

static int uring_write(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    return uring_start(q, r, idx, 1);
}

/* Every completion the ring has: the number. */
static int uring_reap(struct nq_queue *q)
{
    if (!q->ring)
        return 0;
    int total = 0, n;
    do {
        n = nr_uring_reap(q->ring, q->ring_done, (int)q->nreqs);
        for (int i = 0; i < n; i++)
            nq_backend_done(q, (uint32_t)q->ring_done[i].cookie, q->ring_done[i].res);
        total += n > 0 ? n : 0;
    } while (n == (int)q->nreqs && q->ring && q->state < NQ_Q_CLOSED);
    return total;
}

/* One io_uring_enter for everything queued on the ring this poll.  A failed submit (the kernel short of memory)
 * leaves them queued: the next poll tries again. */
static int uring_submit(struct nq_queue *q)
{
    uint32_t queued = q->ring_queued;
    if (!queued || !q->ring)
        return 0;
    int n = nr_uring_submit(q->ring);
    q->ring_submits++;
    if (n > 0)
        q->ring_queued = (uint32_t)n >= q->ring_queued ? 0 : q->ring_queued - (uint32_t)n;
    return (int)queued;
}

static int uring_fd(struct nq_queue *q)
{
    return q->ring ? nr_uring_eventfd(q->ring) : -1;
}

const struct nq_backend_ops nq_backend_uring = {
    .name = "file", /* file and block namespaces: the Python kinds "file" and "block" */
    .flags = NQ_BE_STAGED | NQ_BE_NEEDS_FILE,
    .submit_read = uring_read,
    .submit_write = uring_write,
    .reap = uring_reap,
    .submit = uring_submit,
    .fd = uring_fd,
};
