/* The native data path's per-command trace (docs/native.md, "The per-command trace"), as SPDK's tracepoints: each
 * queue may have a ring of fixed-size records that C fills at each event of a command and Python takes and prints
 * (transport/rdma/native_trace.py), in the Python data path's trace lines.
 *
 * Off (the default) a queue's ring pointer is NULL and each event costs one predictable branch (NT_TRACE).  On,
 * an event is a clock read and a 40-byte store.  The ring has one producer (whoever polls or posts on the queue:
 * the event loop, or a poll group's thread holding the queue's mutex) and one consumer (the event loop): head and
 * tail are atomics, no lock.  A full ring drops the event and counts it; a command is never held for its trace.
 */
#ifndef NVMEOF_ROCE_TRACE_H
#define NVMEOF_ROCE_TRACE_H

#include <stdint.h>

enum nt_event {
    NT_RECEIVED = 1,    /* a capsule arrived: cid, opcode, nsid; length its bytes */
    NT_DATA_POSTED,     /* an RDMA READ (NT_FLAG_RDMA_READ) or WRITE posted: addr, key, length */
    NT_DATA_DONE,       /* a Write's data is in (its RDMA READ completed), or (NT_FLAG_FILE) the device's read or
                         * write finished: length the bytes, a negative errno as an int32 */
    NT_RESPONSE_POSTED, /* the response SEND posted: cid, status; key the host's key it invalidates */
    NT_RESPONSE_DONE,   /* its send completion: the command's slot is free again */
    NT_TO_CORE,         /* handed to the Python core with its capsule: cid, opcode, nsid, length */
};

#define NT_FLAG_RDMA_READ 1
#define NT_FLAG_INVALIDATE 2
#define NT_FLAG_FILE 4
#define NT_NO_CID 0xFFFF /* the Python side's RDMA READ: the C queue knows its tag, not its command */

struct nt_record {
    uint64_t ns; /* CLOCK_MONOTONIC */
    uint64_t addr;
    uint32_t length;
    uint32_t nsid;
    uint32_t key;
    uint16_t cid;
    uint16_t status;
    uint8_t event;
    uint8_t opcode;
    uint8_t flags;
    uint8_t reserved[5];
};

struct nt_ring;

void nt_record(struct nt_ring *ring, uint8_t event, uint16_t cid, uint8_t opcode, uint32_t nsid, uint16_t status,
               uint32_t length, uint64_t addr, uint32_t key, uint8_t flags);
/* an event of a capsule (NT_RECEIVED, NT_TO_CORE): cid, opcode and nsid read from its SQE */
void nt_record_capsule(struct nt_ring *ring, uint8_t event, const uint8_t *sqe, uint32_t length);
/* a response posted: its data WRITE first when length, then its SEND (cid and status read from the CQE) */
void nt_record_response(struct nt_ring *ring, const uint8_t *cqe, uint32_t length, uint64_t raddr, uint32_t rkey,
                        int invalidate, uint32_t invalidate_rkey);

/* The hook at each event: nothing but this test while the trace is off. */
#define NT_TRACE(ring, record, ...)                                                                                 \
    do {                                                                                                            \
        if (__builtin_expect((ring) != NULL, 0))                                                                    \
            record((ring), __VA_ARGS__);                                                                            \
    } while (0)

void nt_ring_free(struct nt_ring *ring);

#ifdef Py_PYTHON_H /* the Python side's calls on a queue's ring; the owner's lock guards the pointer against its poll
                    * thread */
PyObject *nt_set_trace(struct nt_ring **ring, uint32_t qp_num, PyObject *records, void (*lock)(void *),
                       void (*unlock)(void *), void *owner);
PyObject *nt_take_trace(struct nt_ring *ring);

/* A queue type's set_trace / take_trace methods, for a struct with `struct nt_ring *member`, its QP number as an
 * expression of `q` and lock/unlock functions of it (csrc/nq_type.c: one line defines them, one lists them). */
#define NT_QUEUE_METHODS(type, member, qp_num_of_q, lock, unlock)                                                     \
    static void type##_trace_lock(void *q) { lock((type *)q); }                                                     \
    static void type##_trace_unlock(void *q) { unlock((type *)q); }                                                 \
    static PyObject *type##_set_trace(type *q, PyObject *records)                                                   \
    {                                                                                                               \
        return nt_set_trace(&q->member, (qp_num_of_q), records, type##_trace_lock, type##_trace_unlock, q);          \
    }                                                                                                               \
    static PyObject *type##_take_trace(type *q, PyObject *noargs) { return nt_take_trace(q->member); }

#define NT_QUEUE_METHOD_DEFS(type)                                                                                  \
    {"set_trace", (PyCFunction)type##_set_trace, METH_O,                                                            \
     "set_trace(records): the per-command trace on, in a ring of `records` (rounded up to a power of two; the "     \
     "records taken are dropped), or off (0)."},                                                                    \
    {"take_trace", (PyCFunction)type##_take_trace, METH_NOARGS,                                                     \
     "take_trace() -> (qp_num, dropped, records) since the last take, records packed as transport/rdma/"            \
     "native_trace.py reads them; None when the trace is off."},
#endif /* Py_PYTHON_H */

#endif
