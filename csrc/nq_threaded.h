/* What a poll group's thread (csrc/pollgroup.c: threads that poll native queues without the GIL, docs/native.md,
 * "Poll groups") may do with a native queue: the contract csrc/nq_type.c provides.  What such a queue hands to the
 * event loop goes through its mailbox (csrc/mailbox.h).  One way: pollgroup.c calls nq_type.c, never the other way
 * (the module registers _native.PollGroup itself, csrc/module.c); tests/unit/test_architecture.py checks it. */
#ifndef NVMEOF_ROCE_NQ_THREADED_H
#define NVMEOF_ROCE_NQ_THREADED_H

#include <stdint.h>

/* csrc/nq_type.c, for the poll thread: lock the queue, poll it unless it is stopped, closed or failed, wake the loop
 * when its mailbox has something, unlock.  Returns the completions handled.  Called without the GIL. */
int native_queue_poll_threaded(void *queue, int budget);
/* csrc/nq_type.c: the queue's poll group is leaving it (holding its mutex): nothing of it is polled or posted after
 * this returns.  Called with the GIL. */
void native_queue_stop(void *queue);
/* csrc/nq_type.c: make the queue a poll group's (its mutex, its mailbox); -1 with a Python error. */
int native_queue_attach(void *queue);
int native_queue_check(void *obj); /* 1 when obj is a _native.Queue */

#endif
