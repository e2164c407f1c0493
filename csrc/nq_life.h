/* A native queue's lifetime (struct nq_queue's `state`, docs/native.md "Closing a queue"): one state, moved along
 * the edges of nq_qnext only (nq_qmove), as a request's is along nq_next (csrc/nq_hot.c).  The Python side's
 * NativeTargetQueue keeps its own (transport/rdma/native_queue.py QueueLife), which this one follows.
 *
 * The states are ordered so that what the per-command path asks is one compare: a queue polls and posts while it
 * is below NQ_Q_FAILED (nq_q_live), takes new commands only while NQ_Q_SERVING, and is its owner's to free from
 * NQ_Q_CLOSED on.  Moves are rare (once or twice in a queue's life), so each is checked in every build: an illegal
 * one is refused (the state stays), and aborts the test builds (-DNQ_CHECKED). */
#ifndef NVMEOF_ROCE_NQ_LIFE_H
#define NVMEOF_ROCE_NQ_LIFE_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

enum nq_qstate {
    NQ_Q_SERVING = 0,     /* commands taken, responses posted */
    NQ_Q_CLOSING = 1,     /* begin_close: no new command; the responses already made still leave (the QP stays) */
    NQ_Q_CLOSE_READY = 2, /* a poll group's closing queue: its send queue emptied and the loop was told (mailed) */
    NQ_Q_FAILED = 3,      /* a post refused, a work completion failed, or the owner put the QP in the error state
                             (fail_status says which): nothing more is posted; what the QP flushes may be reaped */
    NQ_Q_STOPPED = 4,     /* its poll group let it go: nothing is polled or posted (a fail_status stays) */
    NQ_Q_CLOSED = 5,      /* close(): the owner destroyed the QP; the slots are let go, the ring may still hold
                             commands (their bounce chunks stay the kernel's) */
    NQ_Q_RELEASED = 6,    /* the ring's last command came back: ring freed, bounce memory the owner's again */
    NQ_QSTATES
};

#define NQ_QTO(s) (1u << (s))

/* The states each state may move to. */
static const uint8_t nq_qnext[NQ_QSTATES] __attribute__((unused)) = {
    [NQ_Q_SERVING] = NQ_QTO(NQ_Q_CLOSING) | NQ_QTO(NQ_Q_FAILED) | NQ_QTO(NQ_Q_STOPPED) | NQ_QTO(NQ_Q_CLOSED),
    [NQ_Q_CLOSING] = NQ_QTO(NQ_Q_CLOSE_READY) | NQ_QTO(NQ_Q_FAILED) | NQ_QTO(NQ_Q_STOPPED) | NQ_QTO(NQ_Q_CLOSED),
    [NQ_Q_CLOSE_READY] = NQ_QTO(NQ_Q_FAILED) | NQ_QTO(NQ_Q_STOPPED) | NQ_QTO(NQ_Q_CLOSED),
    [NQ_Q_FAILED] = NQ_QTO(NQ_Q_STOPPED) | NQ_QTO(NQ_Q_CLOSED),
    [NQ_Q_STOPPED] = NQ_QTO(NQ_Q_CLOSED),
    [NQ_Q_CLOSED] = NQ_QTO(NQ_Q_RELEASED),
    [NQ_Q_RELEASED] = 0,
};

static const char *const nq_qstate_names[NQ_QSTATES] __attribute__((unused)) = {
    "SERVING", "CLOSING", "CLOSE_READY", "FAILED", "STOPPED", "CLOSED", "RELEASED"};

/* Move *state to `to`: 0, or -1 (and no move) when nq_qnext has no such edge; the test builds abort then. */
static inline int nq_qmove(int *state, enum nq_qstate to, uint16_t qid)
{
    if ((unsigned)*state < NQ_QSTATES && (nq_qnext[*state] & NQ_QTO(to))) {
        *state = to;
        return 0;
    }
#ifdef NQ_CHECKED
    fprintf(stderr, "csrc/nq_life.h: queue %u moved from %s to %s, which nq_qnext does not allow\n", qid,
            (unsigned)*state < NQ_QSTATES ? nq_qstate_names[*state] : "?", nq_qstate_names[to]);
    abort();
#endif
    return -1;
}

#endif
