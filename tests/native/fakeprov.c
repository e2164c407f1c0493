/* A fake verbs provider for the native queue's tests: no device, no driver.
 *
 * libibverbs' hot calls (ibv_post_send, ibv_post_recv, ibv_poll_cq, ibv_req_notify_cq) are static inlines that
 * jump through qp->context->ops / cq->context->ops, so a struct ibv_context whose ops are ours stands in for a
 * device.  The "wire" is this file: it executes RDMA READ and WRITE by memcpy between the host's buffers
 * (registered here with an rkey) and the target's (registered with an lkey), checks every key and bound as an
 * RC QP would (a bad one completes the work request with an access error and puts the QP in the error state,
 * flushing the rest), records each response SEND for the test, and turns each capsule the test injects into a
 * receive completion.  Built by the tests into a small .so (tests/unit/native_fake.py), never into the product.
 *
 * The fault model.  A posted send work request is put on the wire; its data moves (and its SEND reaches the
 * host) only when its completion is generated, in post order, as on a real link, where the memory stays the
 * target's until then.  By default completions are generated when a CQ is polled, so a poll after a post finds
 * them; with the wire held (fakehost_hold) nothing is generated until the test releases the next N work requests
 * (fakehost_release), which opens the window between a post and its completion.  fakehost_fail_post makes the
 * Nth post_send or post_recv from now return an errno with *bad set, as a provider whose queue is full does;
 * fakehost_qp_error moves the QP to the error state: every work request on the wire and every posted receive
 * completes with IBV_WC_WR_FLUSH_ERR, and so does every later post.  fakehost_stage holds one capsule back until
 * a chosen moment: the Nth poll_cq from now (a host's next command arriving while the target polls), or the next
 * req_notify_cq (one arriving between the target's last poll and its arm, which raises no event).
 *
 * The provider's entry points are fake_post_send, fake_post_recv, fake_poll_cq and fake_req_notify_cq:
 * nvmeof_roce/bench/cost/native.py excludes them from the target's instructions; what the tests call is fakehost_*.
 * Every entry point holds the device's mutex, as a real provider's QP and CQ locks do: a poll group's thread
 * (csrc/pollgroup.c) posts and polls while the test delivers capsules and collects responses.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>

#define FAKE_MRS 1024
#define FAKE_RING 8192
#define FAKE_RESPONSES 65536

struct fake_mr {
    uint64_t addr, len;
    uint32_t key;
    int valid;
};

struct fake_ring {
    struct ibv_wc wc[FAKE_RING];
    uint32_t head, count;
    uint64_t overflow;
};

struct fake_response {
    uint8_t cqe[16];
    uint32_t invalidated_rkey;
    uint32_t flags; /* 1: SEND with invalidate */
};

/* A send work request on the wire: what it needs once its completion is generated (an inline SEND's bytes are
 * copied at post time, as a provider does; every other buffer is read or written at completion). */
struct fake_wire_wr {
    uint64_t wr_id, local_addr, remote_addr;
    uint32_t length, lkey, rkey, invalidate_rkey;
    enum ibv_wr_opcode opcode;
    unsigned int send_flags;
    int num_sge;
    uint8_t inline_data[16];
};

/* An injected post failure: the `countdown`th post from now returns `err`. */
struct fake_post_fault {
    uint32_t countdown;
    int err;
};

struct fake_dev {
    struct ibv_context ctx;
    pthread_mutex_t lock;
    struct ibv_pd pd;
    struct ibv_cq send_cq, recv_cq;
    struct ibv_qp qp;
    int shared_cq;
    struct fake_mr local[FAKE_MRS], remote[FAKE_MRS];
    int nlocal, nremote;
    uint32_t next_key;
    struct {
        uint64_t wr_id, addr;
        uint32_t len, lkey;
    } recvs[FAKE_RING];
    uint32_t recv_head, recv_count;
    struct fake_ring scq, rcq;
    struct fake_response *responses;
    uint32_t nresponses;
    struct fake_wire_wr wire[FAKE_RING];
    uint32_t wire_head, wire_count;
    int hold; /* completions are generated only by fakehost_release */
    struct fake_post_fault send_fault, recv_fault;
    int qp_error;
    uint64_t flushed, post_faults;
    uint64_t post_send_calls, post_recv_calls, poll_calls, arm_calls, wrs_posted, rnr, reads, writes;
    uint64_t bytes_read, bytes_written;
    /* fakehost_stage: a capsule delivered at the `stage_polls`th poll_cq from now, or at the next arm (0) */
    uint8_t stage[8192];
    uint32_t stage_len, stage_polls;
    int staged;
};

#define DEV(c) ((struct fake_dev *)(c))

static void fake_push(struct fake_ring *ring, uint64_t wr_id, enum ibv_wc_status status, enum ibv_wc_opcode op,
                      uint32_t byte_len)
{
    if (ring->count == FAKE_RING) {
        ring->overflow++;
        return;
    }
    struct ibv_wc *wc = &ring->wc[(ring->head + ring->count++) % FAKE_RING];
    memset(wc, 0, sizeof *wc);
    wc->wr_id = wr_id;
    wc->status = status;
    wc->opcode = op;
    wc->byte_len = byte_len;
}

static struct fake_mr *fake_find(struct fake_mr *table, int n, uint32_t key, uint64_t addr, uint64_t len)
{
    for (int i = 0; i < n; i++) {
        struct fake_mr *m = &table[i];
        if (m->key == key && m->valid)
            return (addr >= m->addr && len <= m->len && addr - m->addr <= m->len - len) ? m : NULL;
    }
    return NULL;
}

static void fake_generate(struct fake_dev *d, uint32_t n);
static int fakehost_deliver_locked(void *dev, const void *capsule, uint32_t len);

static int fake_poll_cq_locked(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    struct fake_dev *d = DEV(cq->context);
    struct fake_ring *ring = cq == &d->send_cq ? &d->scq : &d->rcq;
    int got = 0;
    d->poll_calls++;
    if (d->staged && d->stage_polls && !--d->stage_polls) {
        d->staged = 0;
        fakehost_deliver_locked(d, d->stage, d->stage_len);
    }
    if (!d->hold)
        fake_generate(d, UINT32_MAX); /* everything on the wire completes before the poll reaps */
    while (got < n && ring->count) {
        wc[got++] = ring->wc[ring->head];
        ring->head = (ring->head + 1) % FAKE_RING;
        ring->count--;
    }
    return got;
}

static int fake_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc)
{
    struct fake_dev *d = DEV(cq->context);
    pthread_mutex_lock(&d->lock);
    int rc = fake_poll_cq_locked(cq, n, wc);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

static int fake_req_notify_cq_locked(struct ibv_cq *cq, int solicited_only)
{
    struct fake_dev *d = DEV(cq->context);
    d->arm_calls++;
    if (d->staged && !d->stage_polls) { /* it completes just before the arm takes effect: no event */
        d->staged = 0;
        fakehost_deliver_locked(d, d->stage, d->stage_len);
    }
    return 0;
}

static int fake_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    struct fake_dev *d = DEV(cq->context);
    pthread_mutex_lock(&d->lock);
    int rc = fake_req_notify_cq_locked(cq, solicited_only);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

/* Whether this post is the one an injected fault makes fail. */
static int fake_post_fails(struct fake_dev *d, struct fake_post_fault *fault)
{
    if (!fault->countdown || --fault->countdown)
        return 0;
    d->post_faults++;
    return 1;
}

static int fake_post_recv_locked(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    struct fake_dev *d = DEV(qp->context);
    d->post_recv_calls++;
    if (fake_post_fails(d, &d->recv_fault)) {
        *bad = wr;
        return d->recv_fault.err;
    }
    for (; wr; wr = wr->next) {
        if (d->qp_error) { /* a QP in error flushes what is posted on it */
            fake_push(d->shared_cq ? &d->scq : &d->rcq, wr->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0);
            d->flushed++;
            continue;
        }
        if (d->recv_count == FAKE_RING || wr->num_sge != 1) {
            *bad = wr;
            return 12; /* ENOMEM */
        }
        uint32_t i = (d->recv_head + d->recv_count++) % FAKE_RING;
        d->recvs[i].wr_id = wr->wr_id;
        d->recvs[i].addr = wr->sg_list[0].addr;
        d->recvs[i].len = wr->sg_list[0].length;
        d->recvs[i].lkey = wr->sg_list[0].lkey;
    }
    return 0;
}

static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad)
{
    struct fake_dev *d = DEV(qp->context);
    pthread_mutex_lock(&d->lock);
    int rc = fake_post_recv_locked(qp, wr, bad);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

/* One work request's completion is generated: its data moves now.  IBV_WC_SUCCESS, or the status it failed with. */
static enum ibv_wc_status fake_execute(struct fake_dev *d, const struct fake_wire_wr *w)
{
    switch (w->opcode) {
    case IBV_WR_RDMA_WRITE:
    case IBV_WR_RDMA_READ: {
        if (w->num_sge != 1)
            return IBV_WC_LOC_LEN_ERR;
        if (!fake_find(d->local, d->nlocal, w->lkey, w->local_addr, w->length))
            return IBV_WC_LOC_PROT_ERR;
        if (!fake_find(d->remote, d->nremote, w->rkey, w->remote_addr, w->length))
            return IBV_WC_REM_ACCESS_ERR;
        void *remote = (void *)(uintptr_t)w->remote_addr, *local = (void *)(uintptr_t)w->local_addr;
        if (w->opcode == IBV_WR_RDMA_WRITE) {
            memcpy(remote, local, w->length);
            d->writes++;
            d->bytes_written += w->length;
        } else {
            memcpy(local, remote, w->length);
            d->reads++;
            d->bytes_read += w->length;
        }
        return IBV_WC_SUCCESS;
    }
    case IBV_WR_SEND:
    case IBV_WR_SEND_WITH_INV: {
        if (w->num_sge != 1 || w->length != 16)
            return IBV_WC_LOC_LEN_ERR;
        int is_inline = w->send_flags & IBV_SEND_INLINE;
        if (!is_inline && !fake_find(d->local, d->nlocal, w->lkey, w->local_addr, 16))
            return IBV_WC_LOC_PROT_ERR;
        if (w->opcode == IBV_WR_SEND_WITH_INV) { /* the host's receive fails on a key it cannot invalidate */
            int known = 0;
            for (int i = 0; i < d->nremote; i++)
                known |= d->remote[i].key == w->invalidate_rkey && d->remote[i].valid;
            if (!known)
                return IBV_WC_REM_INV_REQ_ERR;
        }
        if (d->nresponses == FAKE_RESPONSES)
            return IBV_WC_REM_INV_REQ_ERR; /* the host's receive ring is full (the test forgot to drain it) */
        struct fake_response *r = &d->responses[d->nresponses++];
        memcpy(r->cqe, is_inline ? w->inline_data : (const void *)(uintptr_t)w->local_addr, 16);
        r->flags = 0;
        r->invalidated_rkey = 0;
        if (w->opcode == IBV_WR_SEND_WITH_INV) {
            r->flags = 1;
            r->invalidated_rkey = w->invalidate_rkey;
            for (int i = 0; i < d->nremote; i++)
                if (d->remote[i].key == w->invalidate_rkey)
                    d->remote[i].valid = 0;
        }
        return IBV_WC_SUCCESS;
    }
    default:
        return IBV_WC_LOC_QP_OP_ERR;
    }
}

static enum ibv_wc_opcode fake_wc_opcode(enum ibv_wr_opcode op)
{
    return op == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ : op == IBV_WR_RDMA_WRITE ? IBV_WC_RDMA_WRITE : IBV_WC_SEND;
}

static struct fake_ring *fake_recv_ring(struct fake_dev *d)
{
    return d->shared_cq ? &d->scq : &d->rcq;
}

/* The QP enters the error state: every work request on the wire and every posted receive completes with a
 * flush error (an RC QP in error completes everything, signaled or not). */
static void fake_enter_error(struct fake_dev *d)
{
    d->qp_error = 1;
    d->qp.state = IBV_QPS_ERR;
    for (; d->wire_count; d->wire_count--, d->wire_head = (d->wire_head + 1) % FAKE_RING) {
        struct fake_wire_wr *w = &d->wire[d->wire_head];
        fake_push(&d->scq, w->wr_id, IBV_WC_WR_FLUSH_ERR, fake_wc_opcode(w->opcode), 0);
        d->flushed++;
    }
    for (; d->recv_count; d->recv_count--, d->recv_head = (d->recv_head + 1) % FAKE_RING) {
        fake_push(fake_recv_ring(d), d->recvs[d->recv_head].wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_RECV, 0);
        d->flushed++;
    }
}

/* Generate the completions of the next `n` work requests on the wire, in post order: each one's data moves now. */
static void fake_generate(struct fake_dev *d, uint32_t n)
{
    while (n-- && d->wire_count) {
        struct fake_wire_wr *w = &d->wire[d->wire_head];
        d->wire_head = (d->wire_head + 1) % FAKE_RING;
        d->wire_count--;
        enum ibv_wc_status status = fake_execute(d, w);
        if (status != IBV_WC_SUCCESS) {
            fake_push(&d->scq, w->wr_id, status, fake_wc_opcode(w->opcode), 0);
            fake_enter_error(d);
            return;
        }
        if (w->send_flags & IBV_SEND_SIGNALED)
            fake_push(&d->scq, w->wr_id, IBV_WC_SUCCESS, fake_wc_opcode(w->opcode),
                      w->opcode == IBV_WR_RDMA_READ ? w->length : 0);
    }
}

static int fake_post_send_locked(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    struct fake_dev *d = DEV(qp->context);
    d->post_send_calls++;
    if (fake_post_fails(d, &d->send_fault)) {
        *bad = wr;
        return d->send_fault.err;
    }
    for (; wr; wr = wr->next) {
        if (d->qp_error) { /* a QP in error flushes what is posted on it */
            d->wrs_posted++;
            fake_push(&d->scq, wr->wr_id, IBV_WC_WR_FLUSH_ERR, fake_wc_opcode(wr->opcode), 0);
            d->flushed++;
            continue;
        }
        if (d->wire_count == FAKE_RING) { /* the send queue is full */
            *bad = wr;
            return 12; /* ENOMEM */
        }
        d->wrs_posted++;
        struct fake_wire_wr *w = &d->wire[(d->wire_head + d->wire_count++) % FAKE_RING];
        struct ibv_sge *sge = wr->num_sge ? wr->sg_list : NULL;
        memset(w, 0, sizeof *w);
        w->wr_id = wr->wr_id;
        w->opcode = wr->opcode;
        w->send_flags = wr->send_flags;
        w->num_sge = wr->num_sge;
        w->local_addr = sge ? sge->addr : 0;
        w->length = sge ? sge->length : 0;
        w->lkey = sge ? sge->lkey : 0;
        w->remote_addr = wr->wr.rdma.remote_addr;
        w->rkey = wr->wr.rdma.rkey;
        w->invalidate_rkey = wr->opcode == IBV_WR_SEND_WITH_INV ? wr->invalidate_rkey : 0;
        if ((wr->send_flags & IBV_SEND_INLINE) && sge && sge->length <= sizeof w->inline_data)
            memcpy(w->inline_data, (const void *)(uintptr_t)sge->addr, sge->length);
    }
    return 0;
}

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad)
{
    struct fake_dev *d = DEV(qp->context);
    pthread_mutex_lock(&d->lock);
    int rc = fake_post_send_locked(qp, wr, bad);
    pthread_mutex_unlock(&d->lock);
    return rc;
}

/* ------------------------------------------------------------------ what the tests call (ctypes) */

void *fakehost_new(int shared_cq)
{
    struct fake_dev *d = calloc(1, sizeof *d);
    if (!d)
        return NULL;
    d->responses = calloc(FAKE_RESPONSES, sizeof *d->responses);
    if (!d->responses) {
        free(d);
        return NULL;
    }
    d->ctx.ops.poll_cq = fake_poll_cq;
    d->ctx.ops.req_notify_cq = fake_req_notify_cq;
    d->ctx.ops.post_send = fake_post_send;
    d->ctx.ops.post_recv = fake_post_recv;
    d->pd.context = &d->ctx;
    d->send_cq.context = d->recv_cq.context = &d->ctx;
    d->qp.context = &d->ctx;
    d->qp.pd = &d->pd;
    d->shared_cq = shared_cq;
    d->qp.send_cq = &d->send_cq;
    d->qp.recv_cq = shared_cq ? &d->send_cq : &d->recv_cq;
    d->qp.qp_type = IBV_QPT_RC;
    d->qp.state = IBV_QPS_RTS;
    d->next_key = 0x1000;
    pthread_mutex_init(&d->lock, NULL);
    return d;
}

void fakehost_free(void *dev)
{
    struct fake_dev *d = dev;
    if (d)
        free(d->responses);
    free(d);
}

void *fakehost_qp(void *dev) { return &DEV(dev)->qp; }
void *fakehost_send_cq(void *dev) { return &DEV(dev)->send_cq; }
void *fakehost_recv_cq(void *dev) { return DEV(dev)->qp.recv_cq; }

static uint32_t fake_reg(struct fake_dev *d, struct fake_mr *table, int *n, uint64_t addr, uint64_t len)
{
    if (*n == FAKE_MRS)
        return 0;
    struct fake_mr *m = &table[(*n)++];
    m->addr = addr;
    m->len = len;
    m->key = d->next_key++;
    m->valid = 1;
    return m->key;
}

static uint32_t fakehost_reg_local_locked(void *dev, uint64_t addr, uint64_t len)
{
    return fake_reg(DEV(dev), DEV(dev)->local, &DEV(dev)->nlocal, addr, len);
}

uint32_t fakehost_reg_local(void *dev, uint64_t addr, uint64_t len)
{
    pthread_mutex_lock(&DEV(dev)->lock);
    uint32_t rc = fakehost_reg_local_locked(dev, addr, len);
    pthread_mutex_unlock(&DEV(dev)->lock);
    return rc;
}

static uint32_t fakehost_reg_remote_locked(void *dev, uint64_t addr, uint64_t len)
{
    return fake_reg(DEV(dev), DEV(dev)->remote, &DEV(dev)->nremote, addr, len);
}

uint32_t fakehost_reg_remote(void *dev, uint64_t addr, uint64_t len)
{
    pthread_mutex_lock(&DEV(dev)->lock);
    uint32_t rc = fakehost_reg_remote_locked(dev, addr, len);
    pthread_mutex_unlock(&DEV(dev)->lock);
    return rc;
}

/* The host SENDs a capsule: into the oldest posted receive, as a receive completion.  -1: no receive posted
 * (an RNR on a real link); -2: longer than the receive buffer; -3: the QP is in the error state. */
static int fakehost_deliver_locked(void *dev, const void *capsule, uint32_t len)
{
    struct fake_dev *d = dev;
    if (d->qp_error)
        return -3;
    if (!d->recv_count) {
        d->rnr++;
        return -1;
    }
    uint32_t i = d->recv_head;
    if (len > d->recvs[i].len)
        return -2;
    d->recv_head = (d->recv_head + 1) % FAKE_RING;
    d->recv_count--;
    if (!fake_find(d->local, d->nlocal, d->recvs[i].lkey, d->recvs[i].addr, len)) {
        fake_push(fake_recv_ring(d), d->recvs[i].wr_id, IBV_WC_LOC_PROT_ERR, IBV_WC_RECV, 0);
        return 0;
    }
    memcpy((void *)(uintptr_t)d->recvs[i].addr, capsule, len);
    fake_push(fake_recv_ring(d), d->recvs[i].wr_id, IBV_WC_SUCCESS, IBV_WC_RECV, len);
    return 0;
}

int fakehost_deliver(void *dev, const void *capsule, uint32_t len)
{
    pthread_mutex_lock(&DEV(dev)->lock);
    int rc = fakehost_deliver_locked(dev, capsule, len);
    pthread_mutex_unlock(&DEV(dev)->lock);
    return rc;
}

/* The responses received since the last call, 24 bytes each: CQE, invalidated rkey, flags. */
static uint32_t fakehost_responses_locked(void *dev, void *out, uint32_t max)
{
    struct fake_dev *d = dev;
    uint32_t n = d->nresponses < max ? d->nresponses : max;
    memcpy(out, d->responses, (size_t)n * sizeof *d->responses);
    memmove(d->responses, d->responses + n, (size_t)(d->nresponses - n) * sizeof *d->responses);
    d->nresponses -= n;
    return n;
}

uint32_t fakehost_responses(void *dev, void *out, uint32_t max)
{
    pthread_mutex_lock(&DEV(dev)->lock);
    uint32_t rc = fakehost_responses_locked(dev, out, max);
    pthread_mutex_unlock(&DEV(dev)->lock);
    return rc;
}

/* Counters: post_send calls, post_recv calls, poll calls, arm calls, work requests, RNRs, READs, WRITEs,
 * receives posted now, QP in error, CQ overflows, work requests on the wire now, flushed work requests (receives
 * too), injected post failures. */
void fakehost_counters(void *dev, uint64_t *out)
{
    struct fake_dev *d = dev;
    pthread_mutex_lock(&d->lock);
    out[0] = d->post_send_calls;
    out[1] = d->post_recv_calls;
    out[2] = d->poll_calls;
    out[3] = d->arm_calls;
    out[4] = d->wrs_posted;
    out[5] = d->rnr;
    out[6] = d->reads;
    out[7] = d->writes;
    out[8] = d->recv_count;
    out[9] = d->qp_error;
    out[10] = d->scq.overflow + d->rcq.overflow;
    out[11] = d->wire_count;
    out[12] = d->flushed;
    out[13] = d->post_faults;
    pthread_mutex_unlock(&d->lock);
}

/* Work requests on the wire whose local memory overlaps [addr, addr + len): their completion would move data there
 * (the native fuzz's guard of memory a live change lets go). */
uint32_t fakehost_on_wire_into(void *dev, uint64_t addr, uint64_t len)
{
    struct fake_dev *d = dev;
    uint32_t n = 0;
    pthread_mutex_lock(&d->lock);
    for (uint32_t i = 0; i < d->wire_count; i++) {
        const struct fake_wire_wr *w = &d->wire[(d->wire_head + i) % FAKE_RING];
        n += w->length && w->local_addr < addr + len && addr < w->local_addr + w->length;
    }
    pthread_mutex_unlock(&d->lock);
    return n;
}

/* ------------------------------------------------------------------ the fault model (what the tests call) */

/* Hold the wire (1): posted work requests stay on it, no completion and no data movement, until released.
 * Not held (0, the default): completions are generated when a CQ is polled. */
void fakehost_hold(void *dev, int hold)
{
    pthread_mutex_lock(&DEV(dev)->lock);
    DEV(dev)->hold = hold;
    pthread_mutex_unlock(&DEV(dev)->lock);
}

/* Generate the completions of the next `n` work requests on the wire (UINT32_MAX: all); the number left on it. */
uint32_t fakehost_release(void *dev, uint32_t n)
{
    struct fake_dev *d = dev;
    pthread_mutex_lock(&d->lock);
    fake_generate(d, n);
    uint32_t left = d->wire_count;
    pthread_mutex_unlock(&d->lock);
    return left;
}

/* The `nth` post_send (recv = 0) or post_recv (recv = 1) from now (1: the next) returns `err` with *bad at its
 * first work request, none of them posted; nth 0 disarms. */
void fakehost_fail_post(void *dev, int recv, int err, uint32_t nth)
{
    struct fake_dev *d = dev;
    pthread_mutex_lock(&d->lock);
    struct fake_post_fault *fault = recv ? &d->recv_fault : &d->send_fault;
    fault->err = err;
    fault->countdown = nth;
    pthread_mutex_unlock(&d->lock);
}

/* Hold `capsule` back: delivered (as fakehost_deliver) at the `polls`th poll_cq from now, or at the next
 * req_notify_cq when `polls` is 0.  -2: longer than the stage; -1: one is staged already. */
int fakehost_stage(void *dev, const void *capsule, uint32_t len, uint32_t polls)
{
    struct fake_dev *d = dev;
    if (len > sizeof d->stage)
        return -2;
    pthread_mutex_lock(&d->lock);
    int rc = -1;
    if (!d->staged) {
        memcpy(d->stage, capsule, len);
        d->stage_len = len;
        d->stage_polls = polls;
        d->staged = 1;
        rc = 0;
    }
    pthread_mutex_unlock(&d->lock);
    return rc;
}

/* 1 while a staged capsule waits for its moment. */
int fakehost_staged(void *dev)
{
    pthread_mutex_lock(&DEV(dev)->lock);
    int staged = DEV(dev)->staged;
    pthread_mutex_unlock(&DEV(dev)->lock);
    return staged;
}

/* Move the QP to the error state (a link down, a retry count exceeded): everything outstanding is flushed. */
void fakehost_qp_error(void *dev)
{
    struct fake_dev *d = dev;
    pthread_mutex_lock(&d->lock);
    fake_enter_error(d);
    pthread_mutex_unlock(&d->lock);
}
