/* The per-command trace's rings (csrc/trace.h). */
/* Built without Python (-DNATIVE_PLAIN_C) for tests/native/nq_hot_test.c: the records only, not the Python calls. */
#ifndef NATIVE_PLAIN_C
#include "native.h"
#endif
#include "trace.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NT_MAX_RECORDS (1u << 20)

_Static_assert(sizeof(struct nt_record) == 40, "transport/rdma/native_trace.py reads 40-byte records");

struct nt_ring {
    uint32_t mask;      /* records - 1 (a power of two) */
    uint32_t qp_num;
    uint32_t head;      /* the next record the producer writes (atomic: the consumer reads it) */
    uint32_t tail;      /* the next record the consumer takes (atomic: the producer reads it) */
    uint64_t dropped;   /* events a full ring had no room for (atomic) */
    struct nt_record records[];
};

void nt_record(struct nt_ring *ring, uint8_t event, uint16_t cid, uint8_t opcode, uint32_t nsid, uint16_t status,
               uint32_t length, uint64_t addr, uint32_t key, uint8_t flags)
{
    uint32_t head = ring->head; /* ours: only the producer writes it */
    if (head - __atomic_load_n(&ring->tail, __ATOMIC_ACQUIRE) > ring->mask) {
        __atomic_fetch_add(&ring->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    struct nt_record *r = &ring->records[head & ring->mask];
    r->ns = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
    r->addr = addr;
    r->length = length;
    r->nsid = nsid;
    r->key = key;
    r->cid = cid;
    r->status = status;
    r->event = event;
    r->opcode = opcode;
    r->flags = flags;
    memset(r->reserved, 0, sizeof r->reserved);
    __atomic_store_n(&ring->head, head + 1, __ATOMIC_RELEASE);
}

void nt_record_capsule(struct nt_ring *ring, uint8_t event, const uint8_t *sqe, uint32_t length)
{
    /* a receive buffer holds at least an SQE, whatever arrived in it */
    uint32_t nsid;
    memcpy(&nsid, sqe + 4, 4);
    nt_record(ring, event, (uint16_t)(sqe[2] | sqe[3] << 8), sqe[0], nsid, 0, length, 0, 0, 0);
}

void nt_record_response(struct nt_ring *ring, const uint8_t *cqe, uint32_t length, uint64_t raddr, uint32_t rkey,
                        int invalidate, uint32_t invalidate_rkey)
{
    uint16_t cid = (uint16_t)(cqe[12] | cqe[13] << 8);
    uint16_t status = (uint16_t)((cqe[14] | cqe[15] << 8) >> 1);
    if (length)
        nt_record(ring, NT_DATA_POSTED, cid, 0, 0, 0, length, raddr, rkey, 0);
    nt_record(ring, NT_RESPONSE_POSTED, cid, 0, 0, status, 0, 0, invalidate ? invalidate_rkey : 0,
              invalidate ? NT_FLAG_INVALIDATE : 0);
}

void nt_ring_free(struct nt_ring *ring)
{
    free(ring);
}

#ifndef NATIVE_PLAIN_C
PyObject *nt_set_trace(struct nt_ring **slot, uint32_t qp_num, PyObject *records, void (*lock)(void *),
                       void (*unlock)(void *), void *owner)
{
    unsigned long want = PyLong_AsUnsignedLong(records);
    if (want == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    if (want > NT_MAX_RECORDS)
        return PyErr_Format(PyExc_ValueError, "set_trace: %lu records; 0 (off) to %u", want, NT_MAX_RECORDS);
    struct nt_ring *fresh = NULL;
    if (want) {
        uint32_t n = 1;
        while (n < want)
            n <<= 1;
        fresh = calloc(1, sizeof *fresh + (size_t)n * sizeof(struct nt_record));
        if (!fresh)
            return PyErr_NoMemory();
        fresh->mask = n - 1;
        fresh->qp_num = qp_num;
    }
    lock(owner);
    struct nt_ring *old = *slot;
    *slot = fresh;
    unlock(owner);
    nt_ring_free(old); /* no poll thread sees it once the lock was let go */
    Py_RETURN_NONE;
}

PyObject *nt_take_trace(struct nt_ring *ring)
{
    if (!ring)
        Py_RETURN_NONE;
    uint32_t tail = ring->tail, head = __atomic_load_n(&ring->head, __ATOMIC_ACQUIRE);
    uint32_t count = head - tail, size = ring->mask + 1;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)count * (Py_ssize_t)sizeof(struct nt_record));
    if (!out)
        return NULL;
    char *dst = PyBytes_AS_STRING(out);
    uint32_t first = tail & ring->mask, upto_end = size - first < count ? size - first : count;
    memcpy(dst, &ring->records[first], (size_t)upto_end * sizeof(struct nt_record));
    memcpy(dst + (size_t)upto_end * sizeof(struct nt_record), ring->records,
           (size_t)(count - upto_end) * sizeof(struct nt_record));
    __atomic_store_n(&ring->tail, head, __ATOMIC_RELEASE);
    uint64_t dropped = __atomic_exchange_n(&ring->dropped, 0, __ATOMIC_RELAXED);
    return Py_BuildValue("(IKN)", ring->qp_num, (unsigned long long)dropped, out);
}
#endif /* NATIVE_PLAIN_C */
