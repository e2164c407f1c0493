/* The native queue's hot path (csrc/nq_hot.c) made and freed: its arrays allocated and its receives posted
 * (nq_queue_init), its io_uring and bounce chunks for file namespaces (nq_enable_files), all of it let go
 * (nq_queue_free).  Plain C, no Python, as nq_hot.c; nothing here runs per command.
 */
#include "nq_hot.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int nq_queue_init(struct nq_queue *q, const struct nq_params *p)
{
    q->qp = p->qp;
    q->send_cq = p->send_cq;
    q->recv_cq = p->recv_cq;
    q->qid = p->qid;
    q->recv_base = p->recv_base;
    q->recv_lkey = p->recv_lkey;
    q->recv_count = p->recv_count;
    q->recv_size = p->recv_size;
    q->nreqs = p->requests;
    q->sq_size = p->send_queue;
    q->native_slots = q->native_slots_total = p->send_queue - p->python_send;
    q->reads_free = p->reads;
    q->remote_invalidate = p->remote_invalidate;
    q->zero_base = p->zero_base;
    q->zero_lkey = p->zero_lkey;
    q->zero_len = p->zero_len;
    q->sink_base = p->sink_base;
    q->sink_lkey = p->sink_lkey;
    q->sink_len = p->sink_len;
    q->hooks = p->hooks;
    q->tell_send_done = p->tell_send_done;
    q->send_wait.head = q->send_wait.tail = UINT32_MAX;
    q->read_wait.head = q->read_wait.tail = UINT32_MAX;
    q->file_wait.head = q->file_wait.tail = UINT32_MAX;
    q->chunk_wait_head = q->chunk_wait_tail = UINT32_MAX;
    q->py_reads_size = p->python_send ? p->python_send : 1;
    q->recv_wrs = calloc(q->recv_count, sizeof *q->recv_wrs);
    q->recv_sges = calloc(q->recv_count, sizeof *q->recv_sges);
    q->repost = calloc(q->recv_count, sizeof *q->repost);
    q->reqs = calloc(q->nreqs, sizeof *q->reqs);
    q->free_stack = calloc(q->nreqs, sizeof *q->free_stack);
    q->sq_log = calloc(q->sq_size, sizeof *q->sq_log);
    q->py_reads = calloc(q->py_reads_size, sizeof *q->py_reads);
    q->batch = calloc(q->sq_size, sizeof *q->batch);
    q->batch_sges = calloc(q->sq_size, sizeof *q->batch_sges);
    q->batch_cqe = calloc(q->sq_size, sizeof *q->batch_cqe);
    q->batch_resp = calloc(q->sq_size, sizeof *q->batch_resp);
    if (!q->recv_wrs || !q->recv_sges || !q->repost || !q->reqs || !q->free_stack || !q->sq_log || !q->py_reads ||
        !q->batch || !q->batch_sges || !q->batch_cqe || !q->batch_resp)
        return -ENOMEM;
    for (uint32_t i = 0; i < q->recv_count; i++) {
        q->recv_sges[i].addr = (uintptr_t)(q->recv_base + (size_t)i * q->recv_size);
        q->recv_sges[i].length = q->recv_size;
        q->recv_sges[i].lkey = q->recv_lkey;
        q->recv_wrs[i].wr_id = NQ_TAG_RECV | i;
        q->recv_wrs[i].sg_list = &q->recv_sges[i];
        q->recv_wrs[i].num_sge = 1;
        q->repost[i] = i;
    }
    for (uint32_t i = 0; i < q->nreqs; i++)
        q->free_stack[i] = q->nreqs - 1 - i;
    q->nfree = q->nreqs;
    /* every receive posted (one doorbell) before the connection is accepted */
    q->nrepost = q->recv_count;
    nq_flush(q);
    return q->fail_status ? (q->fail_status < 0 ? q->fail_status : -EIO) : 0;
}

int nq_enable_files(struct nq_queue *q, char *base, uint32_t lkey, uint32_t len, uint32_t chunk)
{
    uint32_t nchunks = len / chunk < q->nreqs ? len / chunk : q->nreqs;
    q->ring_done = calloc(q->nreqs, sizeof *q->ring_done);
    q->rebuild = calloc(1, q->recv_size);
    q->chunk_free = calloc(nchunks, sizeof *q->chunk_free);
    if (!q->ring_done || !q->rebuild || !q->chunk_free) {
        free(q->ring_done);
        free(q->rebuild);
        free(q->chunk_free);
        q->ring_done = NULL;
        q->rebuild = NULL;
        q->chunk_free = NULL;
        return -ENOMEM;
    }
    int err = 0;
    q->ring = nr_uring_create(q->nreqs, &err);
    if (!q->ring)
        return err;
    q->bounce_base = base;
    q->bounce_lkey = lkey;
    q->bounce_chunk = chunk;
    for (uint32_t i = 0; i < nchunks; i++)
        q->chunk_free[i] = nchunks - 1 - i; /* chunk 0 on top */
    q->nchunks = q->nchunks_free = nchunks;
    q->chunk_wait_head = q->chunk_wait_tail = UINT32_MAX;
    return 0;
}

void nq_queue_free(struct nq_queue *q)
{
    /* The ring's commands complete first (nr_uring_destroy waits: the kernel may write the bounce chunks until
     * then), then the requests' references to their files are let go. */
    nq_staged_closed(q, 1); /* librbd's completions still out let go of their state themselves (csrc/be_rbd.c) */
    if (q->ring) {
        nr_uring_destroy(q->ring);
        q->ring = NULL;
    }
    for (uint32_t i = 0; q->reqs && i < q->nreqs; i++) {
        if (q->reqs[i].file) {
            if (q->reqs[i].state == NQ_FILE_IO)
                __atomic_fetch_sub(&q->reqs[i].file->in_flight, 1, __ATOMIC_RELAXED);
            nq_file_put(q->reqs[i].file);
            q->reqs[i].file = NULL;
        }
        nq_let_go(&q->reqs[i]); /* its owner closed the QP first (a queue freed unclosed: its last chance) */
    }
    free(q->ring_done);
    free(q->rebuild);
    free(q->chunk_free);
    free(q->recv_wrs);
    free(q->recv_sges);
    free(q->repost);
    free(q->reqs);
    free(q->free_stack);
    free(q->sq_log);
    free(q->py_reads);
    free(q->batch);
    free(q->batch_sges);
    free(q->batch_cqe);
    free(q->batch_resp);
    memset(q, 0, sizeof *q);
}
