/* The per-queue mailbox through which a poll group's queue hands what needs Python to the event loop (docs/native.md,
 * "Poll groups"): a FIFO of fixed-size entries and an eventfd.  Plain C: the poll thread pushes (holding the
 * queue's mutex), the loop drains (holding it too). */
#ifndef NVMEOF_ROCE_MAILBOX_H
#define NVMEOF_ROCE_MAILBOX_H

#include <stdint.h>

enum nq_mail_kind {
    NQ_MAIL_CAPSULE = 1,   /* a: the receive slot (not re-posted until drained), b: its length */
    NQ_MAIL_SEND_DONE = 2, /* b: the Python side's tag of a signaled send that completed */
    NQ_MAIL_FAILURE = 3,   /* a: the status (int), b: the work request id */
    NQ_MAIL_HANDBACK = 4,  /* a: the request slot of a file command the device failed (csrc/nq_hot.c) */
    NQ_MAIL_CLOSE_READY = 5, /* a closing queue's send queue emptied: the loop may close it (once per queue) */
};

struct nq_mail {
    uint32_t kind;
    uint32_t a;
    uint64_t b;
};

/* A FIFO the poll thread fills (holding the queue's mutex) and the event loop drains (holding it too); `fd` is an
 * eventfd written once when the FIFO becomes non-empty, so the loop wakes. */
struct nq_mailbox {
    struct nq_mail *ring;
    uint32_t size, head, count;
    int fd;
    int signaled;
};

int nq_mailbox_init(struct nq_mailbox *m, uint32_t size); /* 0, or -1 with errno */
void nq_mailbox_free(struct nq_mailbox *m);
int nq_mailbox_push(struct nq_mailbox *m, uint32_t kind, uint32_t a, uint64_t b); /* 0, or -1 when full */
void nq_mailbox_wake(struct nq_mailbox *m);  /* the eventfd, once per non-empty spell */
void nq_mailbox_clear_wake(struct nq_mailbox *m);

#endif
