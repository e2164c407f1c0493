/* Poll groups (csrc/pollgroup.c): threads that poll native queues without the GIL, and the per-queue mailbox
 * through which such a queue hands what needs Python to the event loop (docs/native.md, "Poll groups"). */
#ifndef NVMEOF_ROCE_POLLGROUP_H
#define NVMEOF_ROCE_POLLGROUP_H

#include <stdint.h>

enum nq_mail_kind {
    NQ_MAIL_CAPSULE = 1,   /* a: the receive slot (not re-posted until drained), b: its length */
    NQ_MAIL_SEND_DONE = 2, /* b: the Python side's tag of a signaled send that completed */
    NQ_MAIL_FAILURE = 3,   /* a: the status (int), b: the work request id */
    NQ_MAIL_HANDBACK = 4,  /* a: the request slot of a file command the device failed (csrc/queue.c) */
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

/* csrc/queue.c, for the poll thread: lock the queue, poll it unless it is stopped, closed or failed, wake the loop
 * when its mailbox has something, unlock.  Returns the completions handled.  Called without the GIL. */
int native_queue_poll_threaded(void *queue, int budget);
/* csrc/queue.c: the queue's poll group is leaving it (holding its mutex): nothing of it is polled or posted after
 * this returns.  Called with the GIL. */
void native_queue_stop(void *queue);
/* csrc/queue.c: make the queue a poll group's (its mutex, its mailbox); -1 with a Python error. */
int native_queue_attach(void *queue);
int native_queue_check(void *obj); /* 1 when obj is a _native.Queue */

#endif
