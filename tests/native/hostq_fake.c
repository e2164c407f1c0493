/* A fake verbs provider and NVMe target for the initiator's native queue (csrc/hostq.c): no device, no driver.
 *
 * libibverbs' ibv_post_send, ibv_post_recv and ibv_poll_cq are static inlines that jump through
 * qp->context->ops / cq->context->ops, so a struct ibv_context whose ops are ours stands in for a device.  The
 * "target" is this file: every SEND the host posts is parsed as an SQE and checked (opcode, PSDT, NSID, NLB, LBA
 * alignment and range, the keyed SGL's address, length, key and type, a CID not already in flight); its response
 * is produced at the host's next poll, into the receive the host posted first, with a status the test may inject
 * every Nth command; after `fail_after` commands a completion fails (connection lost) and the QP flushes.  A
 * hostile target is one call away (fake_misbehave): command N's response arrives 15 bytes long, or names a CID no
 * command has, or comes twice (the copy at the next poll, after the host may have reused the CID).  With a
 * completion channel (fake_channel: a pipe nobody writes, so a sleep on it ends only at its timeout), the responses
 * may be held back until the host arms the CQ (fake_respond_at_arm): each lands just before the arm takes effect,
 * which raises no event, as on a real device when it completes between the host's last poll and its arm.
 * Built by the tests into a small .so (tests/unit/hostq_fake.py), never into the product.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define RING 8192

enum stat {
    ST_COMMANDS, ST_READS, ST_WRITES, ST_BAD, ST_CID_REUSE, ST_ERRORS_SENT, ST_RNR, ST_POST_SEND_CALLS,
    ST_POST_RECV_CALLS, ST_SENDS, ST_SIGNALED, ST_INLINE, ST_MAX_OUTSTANDING, ST_OUTSTANDING, ST_OTHER, ST_POLLS,
    ST_RECVS_POSTED, ST_ARMS, ST_COUNT
};

struct fake {
    struct ibv_context ctx;
    struct ibv_qp qp;
    struct ibv_cq cq;
    struct { uint64_t wr_id, addr; uint32_t len; } recvs[RING];
    uint32_t recv_head, recv_count;
    struct ibv_wc wc[RING];
    uint32_t wc_head, wc_count;
    uint8_t pending[RING][64]; /* SQEs received, answered at the next poll */
    uint32_t pending_head, pending_count;
    uint8_t busy[65536];
    /* what a good command looks like */
    uint32_t nsid, nlb, block_size, rkey;
    uint64_t data_addr, data_len, nblocks;
    uint32_t error_every, fail_after;
    uint16_t error_status;
    int failed;
    uint64_t stats[ST_COUNT];
    uint64_t first_bad; /* the first bad command's number + 1, with the reason in bad_reason */
    int bad_reason;
    int misbehave;      /* enum misbehave, on command misbehave_at */
    uint64_t misbehave_at;
    uint8_t stale[16];  /* a response already sent, sent again at the next poll */
    int stale_pending;
    struct ibv_comp_channel channel; /* fd: the read end of a pipe nobody writes (-1 until fake_channel) */
    int channel_write_fd;
    int respond_at_arm; /* responses are produced at req_notify_cq instead of at poll_cq */
};

enum misbehave { BEHAVE, SHORT_RESPONSE, FOREIGN_CID, DUPLICATE_RESPONSE };
#define FOREIGN_CID_VALUE 0xFFFF

static void push_wc(struct fake *f, uint64_t wr_id, enum ibv_wc_status status, enum ibv_wc_opcode op, uint32_t len)
{
    if (f->wc_count == RING)
        abort(); /* the host never polls: a test bug */
    struct ibv_wc *wc = &f->wc[(f->wc_head + f->wc_count++) % RING];
    memset(wc, 0, sizeof *wc);
    wc->wr_id = wr_id;
    wc->status = status;
    wc->opcode = op;
    wc->byte_len = len;
    wc->qp_num = f->qp.qp_num;
}

static void bad(struct fake *f, int reason)
{
    f->stats[ST_BAD]++;
    if (!f->first_bad) {
        f->first_bad = f->stats[ST_COMMANDS];
        f->bad_reason = reason;
    }
}

static void check_io(struct fake *f, const uint8_t *sqe)
{
    uint32_t nsid, cdw12, key;
    uint64_t slba, addr;
    memcpy(&nsid, sqe + 4, 4);
    memcpy(&addr, sqe + 24, 8);
    memcpy(&key, sqe + 35, 4);
    memcpy(&slba, sqe + 40, 8);
    memcpy(&cdw12, sqe + 48, 4);
    uint32_t len = sqe[32] | sqe[33] << 8 | sqe[34] << 16;
    if (sqe[1] != 0x40)
        bad(f, 1); /* PSDT: SGL */
    if (nsid != f->nsid)
        bad(f, 2);
    if ((cdw12 & 0xFFFF) + 1 != f->nlb)
        bad(f, 3);
    if (slba % f->nlb || slba + f->nlb > f->nblocks)
        bad(f, 4);
    if (sqe[39] != 0x40 || key != f->rkey || len != f->block_size)
        bad(f, 5);
    if (addr < f->data_addr || addr + len > f->data_addr + f->data_len || (addr - f->data_addr) % f->block_size)
        bad(f, 6);
    f->stats[sqe[0] == 0x01 ? ST_WRITES : ST_READS]++;
}

static int fake_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr)
{
    struct fake *f = (struct fake *)qp->context;
    f->stats[ST_POST_SEND_CALLS]++;
    for (; wr; wr = wr->next) {
        f->stats[ST_SENDS]++;
        if (wr->send_flags & IBV_SEND_INLINE)
            f->stats[ST_INLINE]++;
        if (f->failed) {
            push_wc(f, wr->wr_id, IBV_WC_WR_FLUSH_ERR, IBV_WC_SEND, 0);
            continue;
        }
        if (wr->opcode != IBV_WR_SEND || wr->num_sge != 1 || wr->sg_list[0].length < 64) {
            bad(f, 7);
            continue;
        }
        const uint8_t *sqe = (const uint8_t *)(uintptr_t)wr->sg_list[0].addr;
        uint16_t cid = sqe[2] | sqe[3] << 8;
        f->stats[ST_COMMANDS]++;
        if (sqe[0] == 0x01 || sqe[0] == 0x02) {
            check_io(f, sqe);
            if (f->busy[cid])
                f->stats[ST_CID_REUSE]++;
            f->busy[cid] = 1;
            if (++f->stats[ST_OUTSTANDING] > f->stats[ST_MAX_OUTSTANDING])
                f->stats[ST_MAX_OUTSTANDING] = f->stats[ST_OUTSTANDING];
        } else {
            f->stats[ST_OTHER]++;
        }
        if (f->pending_count == RING)
            abort();
        memcpy(f->pending[(f->pending_head + f->pending_count++) % RING], sqe, 64);
        if (wr->send_flags & IBV_SEND_SIGNALED) {
            f->stats[ST_SIGNALED]++;
            push_wc(f, wr->wr_id, IBV_WC_SUCCESS, IBV_WC_SEND, 0);
        }
    }
    return 0;
}

static int fake_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr)
{
    struct fake *f = (struct fake *)qp->context;
    f->stats[ST_POST_RECV_CALLS]++;
    for (; wr; wr = wr->next) {
        if (f->recv_count == RING)
            abort();
        uint32_t at = (f->recv_head + f->recv_count++) % RING;
        f->recvs[at].wr_id = wr->wr_id;
        f->recvs[at].addr = wr->sg_list[0].addr;
        f->recvs[at].len = wr->sg_list[0].length;
        f->stats[ST_RECVS_POSTED]++;
    }
    return 0;
}

/* the oldest receive, or NULL (counted as an RNR) */
static uint8_t *take_recv(struct fake *f, uint64_t *wr_id)
{
    if (!f->recv_count) {
        f->stats[ST_RNR]++;
        return NULL;
    }
    uint32_t at = f->recv_head;
    f->recv_head = (f->recv_head + 1) % RING;
    f->recv_count--;
    *wr_id = f->recvs[at].wr_id;
    return (uint8_t *)(uintptr_t)f->recvs[at].addr;
}

/* answer every pending command: a 16-byte CQE into the oldest receive */
static void respond(struct fake *f)
{
    if (f->stale_pending && !f->failed) {
        uint64_t wr_id;
        uint8_t *cqe = take_recv(f, &wr_id);
        if (cqe) {
            memcpy(cqe, f->stale, 16);
            push_wc(f, wr_id, IBV_WC_SUCCESS, IBV_WC_RECV, 16);
        }
        f->stale_pending = 0;
    }
    while (f->pending_count && !f->failed) {
        const uint8_t *sqe = f->pending[f->pending_head];
        f->pending_head = (f->pending_head + 1) % RING;
        f->pending_count--;
        uint16_t cid = sqe[2] | sqe[3] << 8;
        int io = sqe[0] == 0x01 || sqe[0] == 0x02;
        uint64_t n = f->stats[ST_COMMANDS] - f->pending_count; /* this command's number, from 1 */
        if (f->fail_after && n > f->fail_after) {
            f->failed = 1; /* the connection is lost: this and every later work request flush */
            break;
        }
        uint64_t wr_id;
        uint8_t *cqe = take_recv(f, &wr_id);
        if (!cqe)
            continue;
        int misbehave = f->misbehave_at == n ? f->misbehave : BEHAVE;
        uint16_t answered = misbehave == FOREIGN_CID ? FOREIGN_CID_VALUE : cid;
        memset(cqe, 0, 16);
        cqe[12] = (uint8_t)answered;
        cqe[13] = (uint8_t)(answered >> 8);
        uint16_t status = 0;
        if (io && f->error_every && n % f->error_every == 0) {
            status = (uint16_t)(f->error_status << 1);
            f->stats[ST_ERRORS_SENT]++;
        }
        cqe[14] = (uint8_t)status;
        cqe[15] = (uint8_t)(status >> 8);
        if (io) {
            f->busy[cid] = 0;
            f->stats[ST_OUTSTANDING]--;
        }
        if (misbehave == DUPLICATE_RESPONSE) {
            memcpy(f->stale, cqe, 16);
            f->stale_pending = 1;
        }
        push_wc(f, wr_id, IBV_WC_SUCCESS, IBV_WC_RECV, misbehave == SHORT_RESPONSE ? 15 : 16);
    }
    if (f->failed) { /* the first receive completes in error, the rest flush */
        int first = 1;
        while (f->recv_count) {
            push_wc(f, f->recvs[f->recv_head].wr_id, first ? IBV_WC_RETRY_EXC_ERR : IBV_WC_WR_FLUSH_ERR,
                    IBV_WC_RECV, 0);
            first = 0;
            f->recv_head = (f->recv_head + 1) % RING;
            f->recv_count--;
        }
        f->pending_count = 0;
    }
}

static int fake_poll_cq(struct ibv_cq *cq, int num, struct ibv_wc *wc)
{
    struct fake *f = (struct fake *)cq->context;
    f->stats[ST_POLLS]++;
    if (!f->respond_at_arm)
        respond(f);
    int n = 0;
    while (n < num && f->wc_count) {
        wc[n++] = f->wc[f->wc_head];
        f->wc_head = (f->wc_head + 1) % RING;
        f->wc_count--;
    }
    return n;
}

static int fake_req_notify_cq(struct ibv_cq *cq, int solicited_only)
{
    struct fake *f = (struct fake *)cq->context;
    f->stats[ST_ARMS]++;
    if (f->respond_at_arm)
        respond(f); /* completed just before the arm took effect: no event */
    return 0;
}

struct fake *fake_new(void)
{
    struct fake *f = calloc(1, sizeof *f);
    if (!f)
        return NULL;
    f->ctx.ops.post_send = fake_post_send;
    f->ctx.ops.post_recv = fake_post_recv;
    f->ctx.ops.poll_cq = fake_poll_cq;
    f->ctx.ops.req_notify_cq = fake_req_notify_cq;
    f->channel.fd = f->channel_write_fd = -1;
    f->qp.context = &f->ctx;
    f->qp.qp_num = 17;
    f->cq.context = &f->ctx;
    return f;
}

void fake_free(struct fake *f)
{
    if (f->channel.fd >= 0) {
        close(f->channel.fd);
        close(f->channel_write_fd);
    }
    free(f);
}

/* The CQ's completion channel, made on first use; NULL if no pipe could be made. */
void *fake_channel(struct fake *f)
{
    int fds[2];
    if (f->channel.fd < 0) {
        if (pipe(fds))
            return NULL;
        f->channel.fd = fds[0];
        f->channel_write_fd = fds[1];
        f->channel.context = &f->ctx;
        f->cq.channel = &f->channel;
    }
    return &f->channel;
}

void fake_respond_at_arm(struct fake *f, int on) { f->respond_at_arm = on; }
void *fake_qp(struct fake *f) { return &f->qp; }
void *fake_cq(struct fake *f) { return &f->cq; }

void fake_expect(struct fake *f, uint32_t nsid, uint32_t nlb, uint32_t block_size, uint64_t nblocks, uint64_t data_addr,
                 uint64_t data_len, uint32_t rkey)
{
    f->nsid = nsid;
    f->nlb = nlb;
    f->block_size = block_size;
    f->nblocks = nblocks;
    f->data_addr = data_addr;
    f->data_len = data_len;
    f->rkey = rkey;
}

void fake_inject(struct fake *f, uint32_t error_every, uint16_t error_status, uint32_t fail_after)
{
    f->error_every = error_every;
    f->error_status = error_status;
    f->fail_after = fail_after;
}

/* command `at` (from 1) gets a misbehaving response: 1 short, 2 a foreign CID, 3 a duplicate */
void fake_misbehave(struct fake *f, int kind, uint64_t at)
{
    f->misbehave = kind;
    f->misbehave_at = at;
}

uint64_t fake_stat(struct fake *f, int which) { return which >= 0 && which < ST_COUNT ? f->stats[which] : 0; }
uint64_t fake_first_bad(struct fake *f) { return f->first_bad; }
int fake_bad_reason(struct fake *f) { return f->bad_reason; }
