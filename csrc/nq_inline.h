/* The inline helpers of a native queue's hot path (csrc/nq_hot.c) that its owner's entries (csrc/nq_owner.c) share:
 * the clock, and queueing work requests on the batch the next flush posts (the send queue's log, a work request,
 * a response's SQHD, a response, a Python side's RDMA READ).  Internal to those two files; static inline, so each
 * inlines them as before (no call added to the per-command path). */
#ifndef NQ_INLINE_H
#define NQ_INLINE_H

#include "nq_hot.h"
#include "trace.h"

#include <stdint.h>
#include <string.h>
#include <time.h>

static inline uint64_t nq_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static inline void nq_sq_push(struct nq_queue *q, uint64_t wr_id, uint32_t wrs, uint32_t python)
{
    struct nq_sq_entry *e = &q->sq_log[(q->sq_head + q->sq_count) % q->sq_size];
    e->wr_id = wr_id;
    e->wrs = wrs;
    e->python = python;
    q->sq_count++;
}

static inline struct ibv_send_wr *nq_batch_wr(struct nq_queue *q, uint64_t wr_id, enum ibv_wr_opcode op, int flags,
                                              uint64_t laddr, uint32_t len, uint32_t lkey)
{
    uint32_t i = q->nbatch++;
    struct ibv_send_wr *wr = &q->batch[i];
    struct ibv_sge *sge = &q->batch_sges[i];
    sge->addr = laddr;
    sge->length = len;
    sge->lkey = lkey;
    wr->wr_id = wr_id;
    wr->next = NULL;
    wr->sg_list = sge;
    wr->num_sge = 1;
    wr->opcode = op;
    wr->send_flags = flags;
    return wr;
}

static inline void nq_stamp_sqhd(struct nq_queue *q, uint8_t *cqe)
{
    if (!q->sqhd_on)
        return;
    uint16_t head = 0xFFFF;
    if (!q->sqflow_disabled) {
        q->sqhd = (uint16_t)((q->sqhd + 1) % q->sq_entries);
        head = q->sqhd;
    }
    cqe[8] = head & 0xFF;
    cqe[9] = head >> 8;
}

/* Queue the SEND of a CQE (preceded by its data WRITE when len): the caller counted the entries. */
static inline void nq_batch_response(struct nq_queue *q, uint64_t wr_id, const uint8_t *cqe, uint64_t laddr,
                                     uint32_t lkey, uint32_t len, uint64_t raddr, uint32_t rkey, int invalidate,
                                     uint32_t invalidate_rkey)
{
    NT_TRACE(q->trace, nt_record_response, cqe, len, raddr, rkey, invalidate, invalidate_rkey);
    if (len) {
        struct ibv_send_wr *w = nq_batch_wr(q, NQ_WRITE_WR_ID, IBV_WR_RDMA_WRITE, 0, laddr, len, lkey);
        w->wr.rdma.remote_addr = raddr;
        w->wr.rdma.rkey = rkey;
    }
    uint32_t i = q->nbatch;
    memcpy(q->batch_cqe[i], cqe, NQ_CQE_SIZE);
    nq_stamp_sqhd(q, q->batch_cqe[i]);
    struct ibv_send_wr *s = nq_batch_wr(q, wr_id, invalidate ? IBV_WR_SEND_WITH_INV : IBV_WR_SEND, IBV_SEND_INLINE,
                                        (uintptr_t)q->batch_cqe[i], NQ_CQE_SIZE, 0);
    if (invalidate)
        s->invalidate_rkey = invalidate_rkey;
    q->batch_resp[q->nbatch_resp++] = i;
}

/* A Python side's RDMA READ onto this batch, with one of the queue's READ credits. */
static inline void nq_post_py_read(struct nq_queue *q, const struct nq_py_read *p)
{
    q->reads_free--;
    nq_sq_push(q, NQ_TAG_PY | p->tag, 1, NQ_OWN_PYTHON_READ);
    struct ibv_send_wr *w = nq_batch_wr(q, NQ_TAG_PY | p->tag, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, p->laddr,
                                        p->length, p->lkey);
    w->wr.rdma.remote_addr = p->raddr;
    w->wr.rdma.rkey = p->rkey;
    NT_TRACE(q->trace, nt_record, NT_DATA_POSTED, NT_NO_CID, 0, 0, 0, p->length, p->raddr, p->rkey,
             NT_FLAG_RDMA_READ);
}

#endif
