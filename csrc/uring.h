/* The io_uring engine: one ring per poll group, shared by the Python UringEngine (file and block namespaces)
 * and the native per-queue data path (csrc/nq_hot.c).
 *
 * Usage: queue reads/writes/fsyncs with a caller-chosen cookie, submit the batch with one syscall, wait for
 * the eventfd to become readable, reap completions. Buffers are the caller's (aligned for O_DIRECT when the
 * fd is opened with it) and must stay valid until the completion carrying their cookie is reaped.
 * No call allocates memory per I/O; none blocks except nr_uring_create/nr_uring_destroy.
 * Not thread-safe: one ring is used by one thread at a time (its poll group).
 *
 * Returns: 0 or a count on success, -errno on failure; -EBUSY when the ring is full (submit, reap, retry). */
#ifndef NVMEOF_ROCE_URING_H
#define NVMEOF_ROCE_URING_H

#include <stddef.h>
#include <stdint.h>

struct nr_uring;

struct nr_uring_done {
    uint64_t cookie; /* as given to nr_uring_read/write/fsync */
    int res;         /* bytes transferred (read/write), 0 (fsync), or -errno */
};

/* A ring with room for `depth` commands in flight (queued + submitted, not yet reaped).
 * NULL on failure with *err = -errno (-ENOSYS/-EPERM where io_uring is unavailable). */
struct nr_uring *nr_uring_create(unsigned depth, int *err);

/* Readable (non-blocking, read 8 bytes to clear) when completions are ready to reap. */
int nr_uring_eventfd(struct nr_uring *ring);

/* Queue one command; nothing reaches the kernel before nr_uring_submit. */
int nr_uring_read(struct nr_uring *ring, int fd, void *buf, size_t len, uint64_t off, uint64_t cookie);
int nr_uring_write(struct nr_uring *ring, int fd, const void *buf, size_t len, uint64_t off, uint64_t cookie);
/* A write durable when it completes (RWF_DSYNC: FUA on a block device opened with O_DIRECT). */
int nr_uring_write_fua(struct nr_uring *ring, int fd, const void *buf, size_t len, uint64_t off, uint64_t cookie);
/* fdatasync semantics: every write completed before it is durable. */
int nr_uring_fsync(struct nr_uring *ring, int fd, uint64_t cookie);

/* Hand every queued command to the kernel in one syscall; the number submitted. */
int nr_uring_submit(struct nr_uring *ring);

/* Up to `max` completions into `out` without blocking; the number reaped (0 when none).  The fault injection test
 * hook (_native.uring_inject, uring.c) changes or holds back completions here, and only while it is armed. */
int nr_uring_reap(struct nr_uring *ring, struct nr_uring_done *out, int max);

/* Commands queued or submitted and not yet reaped. */
unsigned nr_uring_in_flight(struct nr_uring *ring);

/* Block until a completion is ready to reap or `timeout_ms` passed (-1: no limit); 0, -ETIME, or -errno. */
int nr_uring_wait(struct nr_uring *ring, int timeout_ms);

/* The completion of nr_uring_cancel's own cancel command (reaped with the others; it is counted in flight). */
#define NR_URING_CANCEL_COOKIE UINT64_MAX

/* Without blocking: hands the queued commands to the kernel and, the first time, asks it to cancel every command
 * in flight that can be (IORING_OP_ASYNC_CANCEL, CANCEL_ANY from 5.19); their completions (and the cancel's own,
 * cookie NR_URING_CANCEL_COOKIE) are reaped as usual.  For a teardown that must not wait: reap until
 * nr_uring_in_flight is 0, then nr_uring_destroy does not block. */
void nr_uring_cancel(struct nr_uring *ring);

/* Cancels the commands in flight that can be (reads waiting on a pipe or socket), waits for the rest (their
 * buffers may be freed after it returns), then frees the ring. */
void nr_uring_destroy(struct nr_uring *ring);

#endif
