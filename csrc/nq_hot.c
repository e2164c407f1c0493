/* The native queue's hot path: one NVMe/RDMA I/O queue's per-command work in C (docs/native.md).  Plain C, no
 * Python: its owner, the CPython type `_native.Queue` (csrc/nq_type.c), makes it, gives it the view, and takes what
 * it hands over (struct nq_hooks); tests/native/nq_hot_test.c drives it with no Python at all.
 *
 * It owns the receive ring, the request slots and the posting on one RC QP whose QP and CQs librdmacm made.  For
 * each receive it parses the SQE and, when the command is a Read, Write or Flush of a namespace of its read-only
 * view and every check passes, does the whole command: RDMA WRITE from the namespace's registered memory chained to
 * the inline response SEND, or RDMA READ straight into it and then the response (a file or block namespace's
 * through its io_uring and a bounce chunk).  Everything else - admin, fabrics, other namespaces, and every command a
 * check fails for (so the error status and the error log entry are the core's own) - is handed to the owner with
 * the capsule, and the owner answers through nq_post_owner_read / nq_post_owner_response (csrc/nq_owner.c, on the
 * batch this file posts): one poster on the QP.
 *
 * A request's life is one checked state machine: the table nq_next lists the moves each state allows, every move
 * goes through nq_move (an abort on any other with -DNQ_CHECKED, the test builds), and nq_process is the one step
 * function of the waiting states (SPDK's nvmf_rdma_request_process), each waiting on the FIFO of its resource.
 *
 * SPDK's tricks (lib/nvmf/rdma.c): inline responses, selective signaling, data WRITE chained before its SEND in
 * one post, one doorbell per poll batch (receives re-posted first, then every send), ibv_poll_cq N at a time,
 * no allocation and no lock per command (slots and work requests are preallocated arrays).
 *
 * Every function of the per-command path is named nq_*; nq_poll is the entry: nvmeof_roce/bench/cost/native.py
 * counts the instructions under it.
 */
#include "nq_hot.h"
#include "nq_inline.h"
#include "trace.h"

#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* The request lifecycle, as the Python side's NEXT (transport/rdma/requests.py): the states each may move to.
 * Every move goes through nq_move; the test builds (-DNQ_CHECKED, make test-native) abort on any other. */
static const uint16_t nq_next[NQ_STATES] __attribute__((unused)) = {
    /* a command taken: a RAM Write's READ to post, a response to post (Read, Flush, in-capsule Write), a file
     * command's chunk to wait for, or its ring command to start (a Read, or a Write's data in the capsule) */
    [NQ_FREE] = NQ_TO(NQ_NEED_READ) | NQ_TO(NQ_NEED_RESPONSE) | NQ_TO(NQ_NEED_CHUNK) | NQ_TO(NQ_NEED_FILE),
    [NQ_NEED_CHUNK] = NQ_TO(NQ_NEED_READ) | NQ_TO(NQ_NEED_FILE),
    /* its READ posted, or its namespace left the view meanwhile: Invalid Namespace */
    [NQ_NEED_READ] = NQ_TO(NQ_READING) | NQ_TO(NQ_NEED_RESPONSE),
    /* the data is in: the response (RAM), the ring's write (file), or Invalid Namespace */
    [NQ_READING] = NQ_TO(NQ_NEED_RESPONSE) | NQ_TO(NQ_NEED_FILE),
    [NQ_NEED_FILE] = NQ_TO(NQ_FILE_IO),
    /* the ring's answer: the response; a failure handed to the core (mailed, or its slot let go at once); or the
     * queue closed and the reap let it go */
    [NQ_FILE_IO] = NQ_TO(NQ_NEED_RESPONSE) | NQ_TO(NQ_HANDED_BACK) | NQ_TO(NQ_FREE),
    [NQ_NEED_RESPONSE] = NQ_TO(NQ_COMPLETING),
    [NQ_COMPLETING] = NQ_TO(NQ_FREE),  /* a send completion retired it */
    [NQ_HANDED_BACK] = NQ_TO(NQ_FREE), /* the loop drained it */
};

#ifdef NQ_CHECKED
static const char *const nq_state_names[NQ_STATES] = {
    "FREE", "NEED_READ", "READING", "NEED_RESPONSE", "COMPLETING", "NEED_CHUNK", "NEED_FILE", "FILE_IO",
    "HANDED_BACK"};

static __attribute__((cold, noinline, noreturn)) void nq_illegal_move(uint32_t idx, int from, int to)
{
    fprintf(stderr, "csrc/nq_hot.c: request %u moved from %s to %s, which nq_next does not allow\n", idx,
            nq_state_names[from], nq_state_names[to]);
    abort();
}
#define nq_move(q, r, to)                                                                                      \
    do {                                                                                                      \
        if (!(nq_next[(r)->state] & NQ_TO(to)))                                                               \
            nq_illegal_move((uint32_t)((r) - (q)->reqs), (r)->state, (to));                                   \
        (r)->state = (to);                                                                                    \
    } while (0)
#else
#define nq_move(q, r, to) ((r)->state = (to))
#endif


void nq_file_put(struct nq_file *f)
{
    if (f && __atomic_sub_fetch(&f->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        if (f->release) {
            f->release(f);
            return;
        }
        close(f->fd);
        free(f);
    }
}

static struct nq_ns *nq_lookup(struct nq_view *view, uint32_t nsid)
{
    int lo = 0, hi = view->count - 1;
    while (lo <= hi) {
        int mid = (lo + hi) >> 1;
        uint32_t got = view->ns[mid].nsid;
        if (got == nsid)
            return &view->ns[mid];
        if (got < nsid)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}

static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* ------------------------------------------------------------------ latency */

/* The bucket bounds in ns, floor(1000 * 2^(i/4)): latency <= bound[i] us  <=>  ns <= this (ns is an integer).
 * Filled once when the module loads; per command the bucket is a binary search of integers. */
static uint64_t nq_lat_bound_ns[NQ_LAT_BOUNDS];

void nq_lat_init(void)
{
    static const double root2[NQ_LAT_STEPS_PER_OCTAVE] = {1.0, 1.189207115002721, 1.4142135623730951,
                                                         1.6817928305074290}; /* 2^(k/4) */
    for (int i = 0; i < NQ_LAT_BOUNDS; i++)
        nq_lat_bound_ns[i] = (uint64_t)(1000.0 * root2[i % NQ_LAT_STEPS_PER_OCTAVE] *
                                        (double)(1ULL << (i / NQ_LAT_STEPS_PER_OCTAVE)));
}

/* The first bucket whose bound is >= ns, or +Inf. */
static inline uint32_t nq_lat_bucket(uint64_t ns)
{
    uint32_t lo = 0, hi = NQ_LAT_BOUNDS;
    while (lo < hi) {
        uint32_t mid = (lo + hi) >> 1;
        if (ns <= nq_lat_bound_ns[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* ------------------------------------------------------------------ posting */

static inline void nq_fifo_push(struct nq_queue *q, struct nq_fifo *f, uint32_t idx)
{
    q->reqs[idx].pending_next = UINT32_MAX;
    if (f->tail == UINT32_MAX)
        f->head = idx;
    else
        q->reqs[f->tail].pending_next = idx;
    f->tail = idx;
}

static inline uint32_t nq_fifo_pop(struct nq_queue *q, struct nq_fifo *f)
{
    uint32_t idx = f->head;
    f->head = q->reqs[idx].pending_next;
    if (f->head == UINT32_MAX)
        f->tail = UINT32_MAX;
    return idx;
}

/* Back at the head: it was popped, and still waits. */
static inline void nq_fifo_unpop(struct nq_queue *q, struct nq_fifo *f, uint32_t idx)
{
    q->reqs[idx].pending_next = f->head;
    f->head = idx;
    if (f->tail == UINT32_MAX)
        f->tail = idx;
}

/* A native request's response: its CQE built here (success, or the status it carries). */
static inline __attribute__((always_inline)) void nq_queue_response(struct nq_queue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    uint8_t cqe[NQ_CQE_SIZE];
    memset(cqe, 0, 8);
    cqe[8] = cqe[9] = 0;
    cqe[10] = q->qid & 0xFF;
    cqe[11] = q->qid >> 8;
    cqe[12] = r->cid & 0xFF;
    cqe[13] = r->cid >> 8;
    uint16_t wire = (uint16_t)(r->status << 1);
    cqe[14] = wire & 0xFF;
    cqe[15] = wire >> 8;
    uint32_t wrs = r->len && r->opc == OPC_READ && !r->status ? 2 : 1;
    q->native_slots -= wrs;
    nq_sq_push(q, idx, wrs, NQ_OWN_NATIVE);
    nq_move(q, r, NQ_COMPLETING);
    if (wrs == 2)
        nq_batch_response(q, idx, cqe, (uintptr_t)r->local, r->lkey, r->len, r->raddr, r->rkey,
                          r->invalidate && q->remote_invalidate, r->rkey);
    else
        nq_batch_response(q, idx, cqe, 0, 0, 0, r->raddr, r->rkey, r->invalidate && q->remote_invalidate, r->rkey);
}

static inline void nq_chunk_take(struct nq_queue *q, struct nq_req *r)
{
    r->chunk = q->chunk_free[--q->nchunks_free];
    r->local = q->bounce_base + (size_t)r->chunk * q->bounce_chunk;
}

/* A staged command onto its backend (csrc/backend.h), in the state NQ_NEED_FILE: 1 when it started (NQ_FILE_IO), 0
 * when its backend has no room now (it waits in file_wait). */
static inline int nq_backend_start(struct nq_queue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    const struct nq_backend_ops *ops = r->ops;
    nq_be_op op = r->opc == OPC_READ    ? ops->submit_read
                  : r->opc == OPC_WRITE ? ops->submit_write
                  : r->opc == OPC_FLUSH ? ops->flush
                  : (rd32(r->sqe + 48) & CDW12_DEAC) ? ops->discard
                                                       : ops->write_zeroes;
    if (op(q, NULL, r, idx) != NQ_BE_STARTED)
        return 0;
    nq_move(q, r, NQ_FILE_IO);
    return 1;
}

/* The request's namespace in the view, as it was when the command arrived (same generation), or NULL. */
static inline struct nq_ns *nq_ns_of(struct nq_queue *q, const struct nq_req *r)
{
    struct nq_ns *ns = q->view ? nq_lookup(q->view, r->nsid) : NULL;
    return ns && ns->gen == r->ns_gen ? ns : NULL;
}

/* The view changed while a Write waited for its READ: if its namespace left the view or changed generation, its
 * destination may be memory that is no longer the namespace's, so no READ is posted and it answers Invalid
 * Namespace (as io._write_data).  1 when it does. */
static __attribute__((cold, noinline)) int nq_check_write_target(struct nq_queue *q, struct nq_req *r)
{
    if (nq_ns_of(q, r))
        return 0;
    if (r->file) {
        nq_file_put(r->file);
        r->file = NULL;
    }
    r->status = SC_INVALID_NS | SC_DNR;
    nq_move(q, r, NQ_NEED_RESPONSE);
    return 1;
}

/* The Python side's READs that waited for a credit, oldest first (they go before the native ones waiting). */
static void nq_py_reads_post(struct nq_queue *q)
{
    while (q->py_reads_count && q->reads_free) {
        nq_post_py_read(q, &q->py_reads[q->py_reads_head]);
        q->py_reads_head = (q->py_reads_head + 1) % q->py_reads_size;
        q->py_reads_count--;
    }
}

static inline struct nq_fifo *nq_wait_of(struct nq_queue *q, uint8_t state)
{
    return state == NQ_NEED_READ ? &q->read_wait : state == NQ_NEED_FILE ? &q->file_wait : &q->send_wait;
}

/* The request's next step from the state it waits in, as SPDK's nvmf_rdma_request_process: 1 when it moved (posted,
 * started on the ring, or moved on to wait for something else), 0 when what it needs is not there. */
static inline int nq_process(struct nq_queue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    switch (r->state) {
    case NQ_NEED_FILE: /* room on its staged backend (its namespace's depth): started */
        return nq_backend_start(q, idx);
    case NQ_NEED_READ: { /* a READ credit and a send-queue entry: its RDMA READ */
        if (__builtin_expect(r->view_seq != q->view_seq, 0) && nq_check_write_target(q, r)) {
            /* now it waits for its response's one entry only, behind the responses waiting (no recursion through
             * nq_advance: both stay inlined in the per-command path) */
            if (q->send_wait.head != UINT32_MAX || !q->native_slots)
                nq_fifo_push(q, &q->send_wait, idx);
            else
                nq_queue_response(q, idx);
            return 1;
        }
        if (!q->native_slots || !q->reads_free || q->py_reads_count)
            return 0;
        q->native_slots--;
        q->reads_free--;
        nq_sq_push(q, idx, 1, NQ_OWN_NATIVE);
        nq_move(q, r, NQ_READING);
        struct ibv_send_wr *w = nq_batch_wr(q, idx, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, (uintptr_t)r->local,
                                            r->len, r->lkey);
        w->wr.rdma.remote_addr = r->raddr;
        w->wr.rdma.rkey = r->rkey;
        NT_TRACE(q->trace, nt_record, NT_DATA_POSTED, r->cid, r->opc, r->nsid, 0, r->len, r->raddr, r->rkey,
                 NT_FLAG_RDMA_READ);
        return 1;
    }
    case NQ_NEED_RESPONSE: { /* the send-queue entries of its (data WRITE and) SEND */
        uint32_t wrs = r->len && r->opc == OPC_READ && !r->status ? 2 : 1;
        if (q->native_slots < wrs)
            return 0;
        nq_queue_response(q, idx);
        return 1;
    }
    default: /* not a waiting state: what moves it on is an event (a completion, the loop's drain) */
#ifdef NQ_CHECKED
        fprintf(stderr, "csrc/nq_hot.c: request %u processed in state %d, which waits for nothing\n", idx, r->state);
        abort();
#endif
        return 1;
    }
}

/* Move a request on, behind the older ones waiting for the same resource (only those). */
static inline void nq_advance(struct nq_queue *q, uint32_t idx)
{
    struct nq_fifo *wait = nq_wait_of(q, q->reqs[idx].state);
    if (wait->head != UINT32_MAX || !nq_process(q, idx))
        nq_fifo_push(q, wait, idx);
}

static __attribute__((noinline)) void nq_resume_fifo(struct nq_queue *q, struct nq_fifo *wait)
{
    while (wait->head != UINT32_MAX) {
        uint32_t idx = nq_fifo_pop(q, wait); /* first: a step may put it on another FIFO */
        if (!nq_process(q, idx)) {
            nq_fifo_unpop(q, wait, idx);
            return;
        }
    }
}

/* Every waiting request that can move now: responses first (their completions give resources back), then the
 * READs (the Python side's before the native ones), then the file commands.  Once per poll: the common case, with
 * nothing waiting, is four tests. */
static inline void nq_resume(struct nq_queue *q)
{
    if (__builtin_expect(q->send_wait.head != UINT32_MAX, 0))
        nq_resume_fifo(q, &q->send_wait);
    if (__builtin_expect(q->py_reads_count != 0, 0))
        nq_py_reads_post(q);
    if (__builtin_expect(q->read_wait.head != UINT32_MAX, 0))
        nq_resume_fifo(q, &q->read_wait);
    if (__builtin_expect(q->file_wait.head != UINT32_MAX, 0))
        nq_resume_fifo(q, &q->file_wait);
}

static void nq_fail(struct nq_queue *q, int status, uint64_t wr_id);

/* A successful Read's or Write's latency, from its receive completion to its response's post, into its namespace's
 * histogram (as engine/io.py records the Python path's). */
static inline void nq_record_latency(struct nq_queue *q, const struct nq_req *r, uint64_t now)
{
    if (r->status || (r->opc != OPC_READ && r->opc != OPC_WRITE) || !q->view)
        return;
    struct nq_ns *ns = nq_ns_of(q, r);
    if (!ns)
        return; /* its namespace left the view meanwhile */
    int kind = r->opc == OPC_READ ? NQ_LAT_READ : NQ_LAT_WRITE;
    uint64_t took = now > r->received_ns ? now - r->received_ns : 0;
    ns->lat[kind][nq_lat_bucket(took)]++;
    ns->lat_sum_ns[kind] += took;
}

/* Post this batch: the receives first (before any response of them, protocol.md §3.5), then every send work
 * request in one ibv_post_send; every SIGNAL_EVERY-th response and the last signaled (all once the native
 * send-queue entries run low). */
void nq_flush(struct nq_queue *q)
{
    if (!nq_q_live(q)) {
        q->nrepost = q->nbatch = q->nbatch_resp = 0;
        return;
    }
    if (q->nrepost) {
        for (uint32_t i = 0; i < q->nrepost; i++)
            q->recv_wrs[q->repost[i]].next = i + 1 < q->nrepost ? &q->recv_wrs[q->repost[i + 1]] : NULL;
        struct ibv_recv_wr *bad_recv;
        int rc = ibv_post_recv(q->qp, &q->recv_wrs[q->repost[0]], &bad_recv);
        q->recv_doorbells++;
        q->nrepost = 0;
        if (rc) {
            nq_fail(q, -rc, 0);
            q->nbatch = q->nbatch_resp = 0;
            return;
        }
    }
    if (!q->nbatch)
        return;
    int low = q->native_slots < q->native_slots_total / 4;
    uint64_t now = 0;
    for (uint32_t k = 0; k < q->nbatch_resp; k++) {
        struct ibv_send_wr *s = &q->batch[q->batch_resp[k]];
        if (s->wr_id & NQ_TAG_PY)
            continue; /* the Python side chose its own signaling (and records its own latencies) */
        if (!now)
            now = nq_now_ns(); /* once per batch: its responses are posted together */
        nq_record_latency(q, &q->reqs[s->wr_id & NQ_TAG_MASK], now);
        q->unsignaled++;
        if (k == q->nbatch_resp - 1 || low || q->unsignaled >= NQ_SIGNAL_EVERY) {
            s->send_flags |= IBV_SEND_SIGNALED;
            q->unsignaled = 0;
        }
    }
    if (__builtin_expect(q->state != NQ_Q_SERVING, 0)) /* closing: its completion says the send queue emptied */
        q->batch[q->nbatch - 1].send_flags |= IBV_SEND_SIGNALED;
    for (uint32_t i = 0; i + 1 < q->nbatch; i++)
        q->batch[i].next = &q->batch[i + 1];
    struct ibv_send_wr *bad;
    int rc = ibv_post_send(q->qp, q->batch, &bad);
    q->doorbells++;
    q->nbatch = q->nbatch_resp = 0;
    if (rc)
        nq_fail(q, -rc, 0);
}

/* ------------------------------------------------------------------ to the owner */

static void nq_fail(struct nq_queue *q, int status, uint64_t wr_id)
{
    if (!nq_q_live(q))
        return;
    q->fail_status = status ? status : -1;
    nq_qmove(&q->state, NQ_Q_FAILED, q->qid);
    if (q->threaded) /* the mailbox keeps a place for it */
        nq_mailbox_push(&q->mail, NQ_MAIL_FAILURE, (uint32_t)status, wr_id);
    else if (q->hooks->failure)
        q->hooks->failure(q, status, wr_id);
}

/* A capsule for the core, handed to the owner (on the event loop's thread). */
static void nq_capsule_to_owner(struct nq_queue *q, const char *capsule, uint32_t len, int handed_back)
{
    q->python_commands++;
    q->hooks->capsule(q, capsule, len, handed_back);
}

/* A received capsule for the core.  A poll group's queue mails it with its receive slot, which is re-posted when
 * the loop drains it (so the mailbox holds at most recv_count capsules and never copies one). */
static void nq_to_python(struct nq_queue *q, uint32_t slot, uint32_t len)
{
    if (q->threaded) {
        q->python_commands++;
        q->nrepost--; /* nq_capsule queued this slot's re-post last */
        if (nq_mailbox_push(&q->mail, NQ_MAIL_CAPSULE, slot, len) < 0)
            nq_fail(q, -ENOSPC, 0);
        return;
    }
    nq_capsule_to_owner(q, q->recv_base + (size_t)slot * q->recv_size, len, 0);
}

/* ------------------------------------------------------------------ per command */


/* A free request slot for a command served natively, with what every such command carries; its index. */
static inline __attribute__((always_inline)) uint32_t nq_req_take(struct nq_queue *q, const struct nq_ns *ns,
                                                                  const uint8_t *sqe, uint8_t opc, uint8_t sgl_id,
                                                                  uint32_t sgl_len, char *local, uint32_t lkey)
{
    uint32_t idx = q->free_stack[--q->nfree];
    struct nq_req *r = &q->reqs[idx];
    r->opc = opc;
    r->cid = sqe[2] | (sqe[3] << 8);
    r->status = 0;
    r->len = sgl_len;
    r->raddr = rd64(sqe + 24);
    r->rkey = rd32(sqe + 35);
    r->invalidate = sgl_id == SGL_KEYED_INVALIDATE && sgl_len;
    r->local = local;
    r->lkey = lkey;
    r->nsid = ns->nsid;
    r->ns_gen = ns->gen;
    r->ref = ns->ref; /* held until its slot is freed: a change to the namespace waits for it (csrc/nq_ref.h) */
    nq_ref_take(ns->ref);
    r->view_seq = q->view_seq;
    r->received_ns = q->polled_ns;
    r->chunk = NQ_NO_CHUNK;
    q->native_commands++;
    return idx;
}

/* An in-place command whose data is where r->local says (or a Flush with nothing to do): its RDMA READ next (a
 * Write), or its response (a Read; a Write whose data came in the capsule, copied here; a Flush). */
static inline __attribute__((always_inline)) void nq_in_place(struct nq_queue *q, struct nq_ns *ns, uint32_t idx,
                                                              const uint8_t *sqe, int in_capsule)
{
    struct nq_req *r = &q->reqs[idx];
    if (in_capsule) { /* a Write's data in the capsule: copied now, answered without a transfer */
        memcpy(r->local, sqe + NQ_SQE_SIZE + rd64(sqe + 24), r->len);
        ns->writes++;
        ns->bytes_written += r->len;
        r->len = 0; /* its response carries no data */
    } else if (r->opc == OPC_WRITE) {
        nq_move(q, r, NQ_NEED_READ);
        nq_advance(q, idx);
        return;
    } else if (r->opc == OPC_READ) {
        ns->reads++;
        ns->bytes_read += r->len;
    } else {
        ns->flushes++;
    }
    nq_move(q, r, NQ_NEED_RESPONSE);
    nq_advance(q, idx);
}

/* A command served through its namespace's entry (csrc/backend.h), off nq_capsule's RAM path: a staged backend's
 * (onto a bounce chunk, then the entry), or in place through the table (a Flush; a Read or Write of an entry
 * without NQ_BE_MEMORY: null).  0 when served or queued; -1 when the core takes it (no slot was kept). */
static __attribute__((noinline)) int nq_capsule_entry(struct nq_queue *q, struct nq_ns *ns, const uint8_t *sqe,
                                                      uint8_t opc, uint8_t sgl_id, uint32_t sgl_len, int in_capsule,
                                                      uint64_t offset, uint32_t op_len)
{
    const struct nq_backend_ops *ops = ns->ops;
    const unsigned be = ns->be_flags;
    nq_be_op op = opc == OPC_READ    ? ops->submit_read
                  : opc == OPC_WRITE ? ops->submit_write
                  : opc == OPC_FLUSH ? ops->flush
                  : (rd32(sqe + 48) & CDW12_DEAC) ? ops->discard
                                                   : ops->write_zeroes;
    if (!op)
        return -1;
    if (opc == OPC_WRITE_ZEROES) { /* a staged entry's (RBD's): no data; an in-place entry's stays the core's
                                    * (Dataset Management is the core's: its ranges come as data) */
        if (sgl_len || !(be & NQ_BE_STAGED))
            return -1;
    } else if (opc == OPC_FLUSH) {
        /* A staged backend without a flush entry (uring: the core's fdatasync, one per namespace at a time): every
         * Write this queue acknowledged before the Flush arrived had completed on its backend before its response
         * was posted, so the core's flush of the same storage covers it. */
        if (sgl_len)
            return -1;
    } else if ((be & NQ_BE_STAGED) &&
               (!q->bounce_base || sgl_len > q->bounce_chunk || (in_capsule && !q->nchunks_free))) {
        /* a staged backend's data goes through a bounce chunk; in-capsule data is copied into one now (its
         * receive is re-posted at the poll's end): with every chunk taken, the core takes the command */
        return -1;
    }
    uint32_t idx = nq_req_take(q, ns, sqe, opc, sgl_id, sgl_len, NULL, 0);
    struct nq_req *r = &q->reqs[idx];
    r->ops = ops;
    r->offset = offset;
    r->op_len = op_len;
    if (!(be & NQ_BE_STAGED)) { /* in place: the entry says where the data is, or does the command now */
        if (op(q, ns, r, idx) != NQ_BE_DONE) {
            q->nfree++; /* the slot back, untouched since it was taken */
            q->native_commands--;
            nq_let_go(r);
            return -1;
        }
        nq_in_place(q, ns, idx, sqe, in_capsule);
        return 0;
    }
    r->lkey = q->bounce_lkey; /* a bounce chunk, taken below or once one is free */
    r->file = nq_file_get(ns->file);
    r->fua = opc == OPC_WRITE && (rd32(sqe + 48) & CDW12_FUA);
    r->icd_len = 0;
    memcpy(r->sqe, sqe, NQ_SQE_SIZE);
    q->file_ios++;
    if (opc == OPC_FLUSH || opc == OPC_WRITE_ZEROES) { /* no data: onto the backend */
        nq_move(q, r, NQ_NEED_FILE);
    } else if (in_capsule) { /* into a bounce chunk: the receive buffer is re-posted at the poll's end */
        nq_chunk_take(q, r);
        r->icd_len = sgl_len;
        memcpy(r->local, sqe + NQ_SQE_SIZE + rd64(sqe + 24), sgl_len);
        nq_move(q, r, NQ_NEED_FILE);
    } else if (q->nchunks_free) {
        nq_chunk_take(q, r);
        nq_move(q, r, opc == OPC_WRITE ? NQ_NEED_READ : NQ_NEED_FILE);
    } else { /* every chunk taken: the next one given back is its (nq_chunk_give) */
        nq_move(q, r, NQ_NEED_CHUNK);
        r->pending_next = UINT32_MAX;
        if (q->chunk_wait_tail == UINT32_MAX)
            q->chunk_wait_head = idx;
        else
            q->reqs[q->chunk_wait_tail].pending_next = idx;
        q->chunk_wait_tail = idx;
        q->chunk_waits++;
        return 0;
    }
    nq_advance(q, idx);
    return 0;
}

/* A capsule arrived in receive slot `slot`: the whole command here, or handed to Python. */
static void nq_capsule(struct nq_queue *q, uint32_t slot, uint32_t len)
{
    const uint8_t *sqe = (const uint8_t *)q->recv_base + (size_t)slot * q->recv_size;
    NT_TRACE(q->trace, nt_record_capsule, NT_RECEIVED, sqe, len);
    q->repost[q->nrepost++] = slot;
    struct nq_view *view = q->view;
    if (len < NQ_SQE_SIZE || !view || !view->ready || !q->nfree)
        goto python;
    uint8_t opc = sqe[0], flags = sqe[1];
    if ((opc > OPC_READ && opc != OPC_WRITE_ZEROES) || (flags & FLAGS_FUSE_MASK) ||
        ((flags & FLAGS_PSDT_MASK) != PSDT_SGL_CONTIG && (flags & FLAGS_PSDT_MASK) != PSDT_SGL_SGL))
        goto python;
    uint8_t sgl_id = sqe[39];
    int in_capsule = sgl_id == SGL_IN_CAPSULE;
    if (sgl_id != SGL_KEYED && sgl_id != SGL_KEYED_INVALIDATE && !(in_capsule && opc == OPC_WRITE))
        goto python;
    struct nq_ns *ns = nq_lookup(view, rd32(sqe + 4));
    if (!ns || ns->paused)
        goto python;
    uint32_t sgl_len = in_capsule ? rd32(sqe + 32) : (uint32_t)(sqe[32] | (sqe[33] << 8) | (sqe[34] << 16));
    if (in_capsule) { /* the data came with the capsule: within this queue's in-capsule size and what arrived */
        uint64_t at = rd64(sqe + 24), end = at + sgl_len;
        if (at > q->recv_size || end > q->recv_size - NQ_SQE_SIZE || NQ_SQE_SIZE + end > len)
            goto python;
    }
    /* A Read or Write of a memory entry (RAM) is served here: its data is at the namespace's registered memory +
     * offset, no call (csrc/backend.h NQ_BE_MEMORY).  Everything else goes through its entry: nq_capsule_entry. */
    uint64_t offset = 0;
    uint32_t op_len = 0;
    if (__builtin_expect(opc == OPC_WRITE_ZEROES, 0)) { /* in range, else the core answers its error */
        uint32_t nlb = (rd32(sqe + 48) & 0xFFFF) + 1;
        uint64_t slba = rd64(sqe + 40);
        if (slba >= ns->num_blocks || nlb > ns->num_blocks - slba || ((uint64_t)nlb << ns->lbads) > UINT32_MAX)
            goto python;
        offset = slba << ns->lbads;
        op_len = nlb << ns->lbads;
    } else if (opc != OPC_FLUSH) { /* a Read or a Write (opc <= OPC_READ) */
        uint32_t nlb = (rd32(sqe + 48) & 0xFFFF) + 1;
        uint64_t slba = rd64(sqe + 40);
        if (sgl_len != ((uint64_t)nlb << ns->lbads) || sgl_len > view->max_transfer ||
            slba >= ns->num_blocks || nlb > ns->num_blocks - slba)
            goto python;
        offset = slba << ns->lbads;
        if (__builtin_expect(ns->be_flags & NQ_BE_MEMORY, 1)) {
            uint32_t idx = nq_req_take(q, ns, sqe, opc, sgl_id, sgl_len, ns->base + offset, ns->lkey);
            nq_in_place(q, ns, idx, sqe, in_capsule);
            return;
        }
    }
    if (nq_capsule_entry(q, ns, sqe, opc, sgl_id, sgl_len, in_capsule, offset, op_len) == 0)
        return;
python:
    NT_TRACE(q->trace, nt_record_capsule, NT_TO_CORE, sqe, len);
    nq_to_python(q, slot, len);
}

/* A bounce chunk given back: the oldest command waiting for one takes it and moves on. */
static void nq_chunk_give(struct nq_queue *q, uint32_t chunk)
{
    q->chunk_free[q->nchunks_free++] = chunk;
    uint32_t next = q->chunk_wait_head;
    if (next == UINT32_MAX)
        return;
    /* the oldest command waiting for a chunk takes it and moves on */
    q->chunk_wait_head = q->reqs[next].pending_next;
    if (q->chunk_wait_head == UINT32_MAX)
        q->chunk_wait_tail = UINT32_MAX;
    struct nq_req *w = &q->reqs[next];
    nq_chunk_take(q, w);
    nq_move(q, w, w->opc == OPC_WRITE ? NQ_NEED_READ : NQ_NEED_FILE);
    nq_advance(q, next);
}

static inline void nq_release_slot(struct nq_queue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    uint32_t chunk = r->chunk;
    r->chunk = NQ_NO_CHUNK;
    nq_move(q, r, NQ_FREE);
    nq_let_go(r); /* nothing of it reaches the namespace any more */
    q->free_stack[q->nfree++] = idx;
    if (chunk != NQ_NO_CHUNK)
        nq_chunk_give(q, chunk);
}

/* A Write's data is in: count it (or answer Invalid Namespace when its namespace left meanwhile), respond. */
static inline void nq_read_done(struct nq_queue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    NT_TRACE(q->trace, nt_record, NT_DATA_DONE, r->cid, r->opc, r->nsid, 0, r->len, 0, 0, 0);
    q->reads_free++;
    struct nq_ns *ns = nq_ns_of(q, r);
    if (r->file) {
        if (!ns) { /* left meanwhile: not written, as io._write_data */
            nq_file_put(r->file);
            r->file = NULL;
            r->status = SC_INVALID_NS | SC_DNR;
            nq_move(q, r, NQ_NEED_RESPONSE);
        } else {
            nq_move(q, r, NQ_NEED_FILE); /* now the file write */
        }
        nq_advance(q, idx);
        return;
    }
    if (!ns) {
        r->status = SC_INVALID_NS | SC_DNR;
    } else {
        ns->writes++;
        ns->bytes_written += r->len;
    }
    nq_move(q, r, NQ_NEED_RESPONSE);
    nq_advance(q, idx);
}

/* A handed-back command's capsule as it arrived: its SQE, or (in-capsule data) rebuilt in q->rebuild from its
 * chunk.  Valid until the request's slot is taken again or the next rebuild. */
const char *nq_handback_capsule(struct nq_queue *q, uint32_t idx, uint32_t *len)
{
    struct nq_req *r = &q->reqs[idx];
    *len = NQ_SQE_SIZE;
    if (!r->icd_len)
        return (const char *)r->sqe;
    uint64_t at = rd64(r->sqe + 24); /* checked against the receive size when it arrived */
    memcpy(q->rebuild, r->sqe, NQ_SQE_SIZE);
    memset(q->rebuild + NQ_SQE_SIZE, 0, at);
    memcpy(q->rebuild + NQ_SQE_SIZE + at, r->local, r->icd_len);
    *len = NQ_SQE_SIZE + (uint32_t)at + r->icd_len;
    return q->rebuild;
}

/* A file/block command the device failed (-errno) or cut short: the core does it again from its capsule, through
 * its own engine, and answers with its own status, error log entry and retries (O_DIRECT refusing an unaligned
 * access, RWF_DSYNC unsupported, the rest of a short transfer) - so an error is the Python path's by construction.
 * Doing it again cannot do harm: a Read has no effect, and a Write not yet acknowledged writes the same bytes to
 * the same blocks (the host may not assume anything of their contents until it is answered); the core fetches
 * the data again from the host (its buffer is the host's until the response) or from the rebuilt capsule. */
static void nq_file_hand_back(struct nq_queue *q, uint32_t idx)
{
    q->file_handed_back++;
    NT_TRACE(q->trace, nt_record_capsule, NT_TO_CORE, q->reqs[idx].sqe, NQ_SQE_SIZE);
    if (q->threaded) { /* the loop takes it with what it drains; the capsule is made there */
        q->python_commands++;
        nq_move(q, &q->reqs[idx], NQ_HANDED_BACK);
        if (nq_mailbox_push(&q->mail, NQ_MAIL_HANDBACK, idx, 0) < 0)
            nq_fail(q, -ENOSPC, 0);
        return;
    }
    uint32_t len;
    const char *capsule = nq_handback_capsule(q, idx, &len);
    nq_release_slot(q, idx);
    nq_capsule_to_owner(q, capsule, len, 1);
}

/* A staged backend finished a command (its `reap`, csrc/backend.h): its response, or the core takes it over. */
void nq_backend_done(struct nq_queue *q, uint32_t idx, int res)
{
    if (q->state >= NQ_Q_CLOSED || idx >= q->nreqs || q->reqs[idx].state != NQ_FILE_IO)
        return; /* closed by a callback during this reap (the ring is gone), or not ours (cookies are slots) */
    struct nq_req *r = &q->reqs[idx];
    NT_TRACE(q->trace, nt_record, NT_DATA_DONE, r->cid, r->opc, r->nsid, 0, (uint32_t)res, 0, 0, NT_FLAG_FILE);
    __atomic_fetch_sub(&r->file->in_flight, 1, __ATOMIC_RELAXED);
    nq_file_put(r->file);
    r->file = NULL;
    if (res < 0 || (uint32_t)res != r->len) { /* r->len: 0 for a command without data */
        nq_file_hand_back(q, idx);
        return;
    }
    struct nq_ns *ns = nq_ns_of(q, r);
    if (r->opc == OPC_READ) {
        if (ns) {
            ns->reads++;
            ns->bytes_read += r->len;
        }
    } else if (!ns) {
        r->status = SC_INVALID_NS | SC_DNR; /* removed while it was written: as io._write_done */
    } else if (r->opc == OPC_WRITE) {
        ns->writes++;
        ns->bytes_written += r->len;
    } else if (r->opc == OPC_FLUSH) {
        ns->flushes++;
    }
    if (r->icd_len)
        r->len = 0; /* a Write's response carries no data */
    /* A Write done on its backend needs its chunk no more (its response is a SEND alone): given back now, not at
     * the response's completion, so a Write arriving meanwhile (in-capsule data has nowhere to wait) finds it. */
    uint32_t chunk = r->opc == OPC_WRITE ? r->chunk : NQ_NO_CHUNK;
    if (chunk != NQ_NO_CHUNK)
        r->chunk = NQ_NO_CHUNK;
    nq_move(q, r, NQ_NEED_RESPONSE);
    nq_advance(q, idx);
    if (chunk != NQ_NO_CHUNK)
        nq_chunk_give(q, chunk);
}

/* A staged backend answered a command with a status of its own (csrc/backend.h): its response, no data. */
void nq_backend_answer(struct nq_queue *q, uint32_t idx, uint16_t status)
{
    if (q->state >= NQ_Q_CLOSED || idx >= q->nreqs || q->reqs[idx].state != NQ_FILE_IO)
        return;
    struct nq_req *r = &q->reqs[idx];
    NT_TRACE(q->trace, nt_record, NT_DATA_DONE, r->cid, r->opc, r->nsid, status, 0, 0, 0, NT_FLAG_FILE);
    __atomic_fetch_sub(&r->file->in_flight, 1, __ATOMIC_RELAXED);
    nq_file_put(r->file);
    r->file = NULL;
    r->status = status;
    nq_move(q, r, NQ_NEED_RESPONSE);
    nq_advance(q, idx);
}

/* A signaled send completion: it and everything posted before it are done (RC completes in order). */
static void nq_send_done(struct nq_queue *q, uint64_t wr_id)
{
    while (q->sq_count) {
        struct nq_sq_entry e = q->sq_log[q->sq_head];
        q->sq_head = (q->sq_head + 1) % q->sq_size;
        q->sq_count--;
        if (e.python == NQ_OWN_NATIVE) {
            uint32_t idx = (uint32_t)(e.wr_id & NQ_TAG_MASK);
            q->native_slots += e.wrs;
            struct nq_req *r = &q->reqs[idx];
            if (r->state == NQ_READING) {
                if (e.wr_id == wr_id)
                    nq_read_done(q, idx);
                else
                    q->reads_free++; /* cannot happen on RC (a READ is signaled): never hang on it */
            } else if (r->state == NQ_COMPLETING) {
                NT_TRACE(q->trace, nt_record, NT_RESPONSE_DONE, r->cid, r->opc, r->nsid, r->status, 0, 0, 0, 0);
                nq_release_slot(q, idx);
            }
        } else if (e.python == NQ_OWN_PYTHON_READ) {
            q->reads_free++; /* and its completion goes to the Python side below */
        }
        if (e.python != NQ_OWN_NATIVE && e.wr_id == wr_id && q->tell_send_done) {
            if (!q->threaded)
                q->hooks->send_done(q, wr_id & NQ_TAG_MASK);
            else if (nq_mailbox_push(&q->mail, NQ_MAIL_SEND_DONE, 0, wr_id & NQ_TAG_MASK) < 0)
                nq_fail(q, -ENOSPC, wr_id);
        }
        if (e.wr_id == wr_id)
            break;
    }
}

static void nq_completion(struct nq_queue *q, struct ibv_wc *wc)
{
    if (wc->status != IBV_WC_SUCCESS) {
        nq_fail(q, wc->status, wc->wr_id);
        return;
    }
    if ((wc->wr_id & (NQ_TAG_RECV | NQ_TAG_PY)) == NQ_TAG_RECV) {
        if (q->state == NQ_Q_SERVING) /* a closing queue takes no new command, nor re-posts its receive */
            nq_capsule(q, (uint32_t)(wc->wr_id & NQ_TAG_MASK), wc->byte_len);
    }
    else
        nq_send_done(q, wc->wr_id);
}

/* One poll: up to `budget` completions, NQ_POLL_BATCH per ibv_poll_cq, then one flush. */
__attribute__((noinline)) int nq_poll(struct nq_queue *q, int budget)
{
    int done = 0;
    q->in_poll = 1;
    q->polls++;
    for (uint32_t i = 0; i < q->nstaged && nq_q_live(q); i++)
        done += q->staged[i]->reap(q); /* staged commands the device finished: their responses */
    while (done < budget && nq_q_live(q)) {
        int n = ibv_poll_cq(q->recv_cq, NQ_POLL_BATCH, q->wc);
        if (n < 0) {
            nq_fail(q, n, 0);
            break;
        }
        if (n)
            q->polled_ns = nq_now_ns(); /* once per batch: the receives' arrival, for the latency histograms */
        for (int i = 0; i < n && nq_q_live(q); i++)
            nq_completion(q, &q->wc[i]);
        int m = 0;
        if (q->send_cq != q->recv_cq && nq_q_live(q)) {
            m = ibv_poll_cq(q->send_cq, NQ_POLL_BATCH, q->wc);
            if (m < 0) {
                nq_fail(q, m, 0);
                break;
            }
            for (int i = 0; i < m && nq_q_live(q); i++)
                nq_completion(q, &q->wc[i]);
        }
        done += n + m;
        if (n < NQ_POLL_BATCH && m < NQ_POLL_BATCH)
            break;
    }
    if (nq_q_live(q))
        nq_resume(q);
    /* One submission for the staged commands this poll started; a read the page cache holds completes inside
     * it, so its response joins this batch instead of waiting for the eventfd (a few rounds at most). */
    for (uint32_t i = 0; i < q->nstaged; i++) {
        const struct nq_backend_ops *ops = q->staged[i];
        for (int round = 0; round < 4 && nq_q_live(q); round++) {
            if (!ops->submit(q)) /* nothing was queued */
                break;
            int n = ops->reap(q);
            if (!n)
                break;
            done += n;
            nq_resume(q);
        }
    }
    nq_flush(q);
    q->in_poll = 0;
    return done;
}

/* ------------------------------------------------------------------ a poll group's queue */

uint32_t nq_latency_bucket(uint64_t ns)
{
    return nq_lat_bucket(ns);
}

/* A handed-back command's slot (and chunk) let go, once the loop drained it. */
void nq_release(struct nq_queue *q, uint32_t idx)
{
    nq_release_slot(q, idx);
}
