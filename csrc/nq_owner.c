/* A native queue's entries for its owner (csrc/nq_type.c, tests/native/nq_hot_test.c) beside the poll itself
 * (csrc/nq_hot.c, nq_poll): adaptive polling (arm, poll_adaptive), the owner's posts (its READs and responses on the
 * queue's one poster), the start of a close and a closed queue's reap of its devices, and a poll group's poll
 * under the queue's mutex.  Plain C, no Python;
 * none of it is on the per-command path of a native Read or Write (docs/native.md). */
#include "nq_hot.h"
#include "nq_inline.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>

/* ------------------------------------------------------------------ adaptive polling */

int nq_arm(struct nq_queue *q)
{
    int rc = ibv_req_notify_cq(q->recv_cq, 0);
    if (!rc && q->send_cq != q->recv_cq)
        rc = ibv_req_notify_cq(q->send_cq, 0);
    if (!rc)
        q->arms++;
    return rc;
}

/* The kernel's hybrid polling and SPDK's interrupt mode do the same: a queue that just had work is likely to have
 * more soon (at QD1: the next command, one round trip after the response), and finding it by polling saves the
 * wake-up of a sleeping thread, which on a loaded machine waits for a CPU.  The spin is bounded from the last
 * completion found, so an idle queue costs at most one bound of CPU before it sleeps.  An empty poll in the spin
 * yields the CPU: where the target shares a CPU with the work it waits for (the host's submitter, the softirq that
 * delivers the next capsule, another queue's thread), a spin that kept the CPU would delay that very work. */
__attribute__((noinline)) int nq_poll_adaptive(struct nq_queue *q, int budget, uint64_t spin_ns, int *armed,
                                               int *arm_rc)
{
    *armed = 0;
    *arm_rc = 0;
    q->hook_error = 0;
    int done = nq_poll(q, budget);
    uint64_t last = done ? nq_now_ns() : 0;
    while (done && done < budget && q->state == NQ_Q_SERVING && !q->hook_error) {
        int n = nq_poll(q, budget - done);
        uint64_t now = nq_now_ns();
        if (n) {
            q->spin_hits++;
            done += n;
            last = now;
        } else if (now - last >= spin_ns) {
            break;
        } else {
            q->spin_yields++;
            sched_yield(); /* cheap when nothing else of this CPU is runnable */
        }
    }
    if (done >= budget || !nq_q_live(q))
        return done;
    *arm_rc = nq_arm(q);
    if (*arm_rc)
        return done;
    *armed = 1;
    int caught = nq_poll(q, budget - done); /* what arrived between the last poll and the arm */
    if (caught)
        q->arm_catches++;
    if (done + caught >= budget)
        *armed = 0; /* more may wait that arrived before the arm, which no event announces: poll again */
    return done + caught;
}

/* ------------------------------------------------------------------ the owner's posts */

int nq_post_owner_read(struct nq_queue *q, const struct nq_py_read *p)
{
    if (q->sq_count + q->py_reads_count >= q->sq_size || q->nbatch >= q->sq_size ||
        (q->py_reads_count == q->py_reads_size && !q->reads_free))
        return -EOVERFLOW;
    if (q->reads_free && !q->py_reads_count) {
        nq_post_py_read(q, p);
        if (!q->in_poll)
            nq_flush(q);
    } else {
        q->py_reads[(q->py_reads_head + q->py_reads_count++) % q->py_reads_size] = *p;
    }
    return 0;
}

int nq_post_owner_response(struct nq_queue *q, uint32_t tag, const uint8_t *cqe, int signaled, uint64_t laddr,
                           uint32_t lkey, uint32_t length, uint64_t raddr, uint32_t rkey, long long invalidate)
{
    uint32_t wrs = length ? 2 : 1;
    if (q->sq_count >= q->sq_size || q->nbatch + wrs > q->sq_size)
        return -EOVERFLOW;
    nq_sq_push(q, NQ_TAG_PY | tag, wrs, NQ_OWN_PYTHON);
    nq_batch_response(q, NQ_TAG_PY | tag, cqe, laddr, lkey, length, raddr, rkey,
                      invalidate >= 0 && q->remote_invalidate, (uint32_t)invalidate);
    if (signaled)
        q->batch[q->nbatch - 1].send_flags |= IBV_SEND_SIGNALED;
    if (!q->in_poll)
        nq_flush(q);
    return 0;
}

/* ------------------------------------------------------------------ closing */

int nq_begin_close(struct nq_queue *q)
{
    if (!nq_q_live(q))
        return 0;
    if (q->state == NQ_Q_SERVING)
        nq_qmove(&q->state, NQ_Q_CLOSING, q->qid);
    nq_flush(q);
    return nq_q_live(q) && q->sq_count > 0;
}

int nq_close_ready(const struct nq_queue *q)
{
    return !nq_q_live(q) || (q->state != NQ_Q_SERVING && !q->sq_count && !q->nbatch);
}

/* The owner put the QP in the error state (rdma_disconnect, before it destroys the QP): every work request still
 * on it completes, flushed.  The queue fails first if it had not (nothing more is posted; the owner is not told:
 * it knows), then the flushed completions are taken off both CQs and dropped: nothing of them is delivered, and
 * their slots are let go by close once the QP is gone.  Polls until every send work request of the send-queue
 * log has come back, or `spin_ns` passed (a device flushes at once or soon); receives are taken as found.
 * Returns the send work requests not seen (0: all reaped).  Not for a poll group's queue still in its group. */
uint32_t nq_reap_flushed(struct nq_queue *q, uint64_t spin_ns)
{
    if (q->state >= NQ_Q_CLOSED)
        return 0;
    if (nq_q_live(q)) {
        q->fail_status = IBV_WC_WR_FLUSH_ERR;
        nq_qmove(&q->state, NQ_Q_FAILED, q->qid);
    }
    q->nbatch = q->nbatch_resp = q->nrepost = 0;
    uint32_t total = 0, sends;
    for (uint32_t i = 0; i < q->sq_count; i++)
        total += q->sq_log[(q->sq_head + i) % q->sq_size].wrs;
    sends = total;
    struct ibv_cq *cqs[2] = {q->recv_cq, q->send_cq != q->recv_cq ? q->send_cq : NULL};
    uint64_t start = nq_now_ns();
    for (;;) {
        int found = 0;
        for (int c = 0; c < 2; c++) {
            int n;
            while (cqs[c] && (n = ibv_poll_cq(cqs[c], NQ_POLL_BATCH, q->wc)) > 0) {
                found += n;
                q->flushed += (uint32_t)n;
                for (int i = 0; i < n; i++)
                    if ((q->wc[i].wr_id & (NQ_TAG_RECV | NQ_TAG_PY)) != NQ_TAG_RECV && sends)
                        sends--; /* a send's (a data WRITE's, NQ_TAG_RECV | NQ_TAG_PY, among them) */
            }
        }
        if (!sends || nq_now_ns() - start >= spin_ns)
            break;
        if (!found)
            sched_yield();
    }
    /* the entries whose work requests all came back leave the send-queue log (in post order, as they flush) */
    for (uint32_t seen = total - sends; q->sq_count && q->sq_log[q->sq_head].wrs <= seen; q->sq_count--) {
        seen -= q->sq_log[q->sq_head].wrs;
        q->sq_head = (q->sq_head + 1) % q->sq_size;
    }
    return sends;
}

/* ------------------------------------------------------------------ a poll group's queue */

int nq_poll_threaded(struct nq_queue *q, int budget)
{
    int done = 0;
    pthread_mutex_lock(&q->lock);
    if (nq_q_live(q))
        done = nq_poll(q, budget);
    if (q->state == NQ_Q_CLOSING && !q->sq_count) { /* the mailbox keeps a place for it (once: CLOSE_READY) */
        nq_qmove(&q->state, NQ_Q_CLOSE_READY, q->qid);
        nq_mailbox_push(&q->mail, NQ_MAIL_CLOSE_READY, 0, 0);
    }
    if (q->state < NQ_Q_STOPPED)
        nq_mailbox_wake(&q->mail);
    pthread_mutex_unlock(&q->lock);
    return done;
}

/* ------------------------------------------------------------------ a closed queue's devices */

/* A closed queue's ring, without waiting: what the kernel finished is reaped (its requests let go of their files),
 * what it still holds is cancelled where it can be; once nothing is left the ring is freed.  Returns the commands
 * still in the kernel: until they come back the kernel may write the bounce chunks, which the owner keeps. */
unsigned nq_closed_reap(struct nq_queue *q)
{
    /* the other staged entries' commands (librbd's): their completions touch nothing of the queue from now on;
     * the ring (its eventfd wakes the owner for them too) and the bounce chunks stay until they are back */
    unsigned staged_left = nq_staged_closed(q, 0);
    if (q->ring) {
        nr_uring_cancel(q->ring);
        int n;
        while ((n = nr_uring_reap(q->ring, q->ring_done, (int)q->nreqs)) > 0) {
            for (int i = 0; i < n; i++) {
                uint64_t idx = q->ring_done[i].cookie;
                if (idx >= q->nreqs || q->reqs[idx].state != NQ_FILE_IO)
                    continue; /* the cancel's own completion */
                struct nq_req *r = &q->reqs[idx];
                __atomic_fetch_sub(&r->file->in_flight, 1, __ATOMIC_RELAXED);
                nq_file_put(r->file);
                r->file = NULL;
                r->state = NQ_FREE; /* NQ_FILE_IO -> NQ_FREE: csrc/nq_hot.c nq_next allows it */
                nq_let_go(r);
            }
        }
        unsigned left = nr_uring_in_flight(q->ring) + staged_left;
        if (left) {
            nq_let_go_off_ring(q); /* the QP is gone: only what the devices still have can reach a namespace */
            return left;
        }
        nr_uring_destroy(q->ring); /* nothing in flight: it does not wait */
        q->ring = NULL;
    } else if (staged_left) {
        return staged_left;
    }
    for (uint32_t i = 0; q->reqs && i < q->nreqs; i++) { /* the requests not on the ring */
        if (q->reqs[i].file) {
            if (q->reqs[i].state == NQ_FILE_IO) /* another staged entry's, back from its device now */
                __atomic_fetch_sub(&q->reqs[i].file->in_flight, 1, __ATOMIC_RELAXED);
            nq_file_put(q->reqs[i].file);
            q->reqs[i].file = NULL;
        }
    }
    nq_let_go_off_ring(q);
    q->ring_queued = 0;
    return 0;
}
