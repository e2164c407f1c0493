/* The native queue: one NVMe/RDMA I/O queue's per-command work in C (docs/native.md).
 *
 * It owns the receive ring, the request slots and the posting on one RC QP whose QP and CQs librdmacm made
 * (handed over as pointers; the CM stays in Python).  For each receive it parses the SQE and, when the command is a
 * Read, Write or Flush of a RAM or null namespace of its read-only view and every check passes, does the whole
 * command: RDMA WRITE from the namespace's registered memory chained to the inline response SEND, or RDMA READ
 * straight into it and then the response.  Everything else - admin, fabrics, other namespaces, and every command
 * a check fails for (so the error status and the error log entry are the Python core's own) - is handed to
 * Python with the capsule, and Python answers through post_read / post_response here: one owner posts on the QP.
 *
 * SPDK's tricks (lib/nvmf/rdma.c): inline responses, selective signaling, data WRITE chained before its SEND in
 * one post, one doorbell per poll batch (receives re-posted first, then every send), ibv_poll_cq N at a time,
 * no allocation and no lock per command (slots and work requests are preallocated arrays).
 *
 * Every function of the per-command path is named nq_*; nq_poll is the entry: nvmeof_roce/bench/cost/native.py
 * counts the instructions under it.
 */
#include "native.h"
#include "mailbox.h"
#include "pollgroup.h"
#include "trace.h"
#include "uring.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <infiniband/verbs.h>

#define NQ_POLL_BATCH 32      /* completions per ibv_poll_cq */
#define NQ_SIGNAL_EVERY 16    /* at most this many responses retired by one send completion */
#define NQ_CQE_SIZE 16
#define NQ_SQE_SIZE 64

/* wr_id: a receive slot; a native request slot; a work request of the Python side (its book's index). */
#define NQ_TAG_RECV (1ULL << 62)
#define NQ_TAG_PY (1ULL << 63)
#define NQ_TAG_MASK ((1ULL << 32) - 1)
#define NQ_WRITE_WR_ID (NQ_TAG_RECV | NQ_TAG_PY) /* an unsignaled data WRITE: never completes alone */

/* NVMe (docs/protocol.md §2, §6) */
#define OPC_FLUSH 0x00
#define OPC_WRITE 0x01
#define OPC_READ 0x02
#define FLAGS_FUSE_MASK 0x03
#define FLAGS_PSDT_MASK 0xC0
#define PSDT_SGL_CONTIG 0x40
#define PSDT_SGL_SGL 0x80
#define SGL_KEYED 0x40
#define SGL_IN_CAPSULE 0x01 /* data block, offset subtype: in-capsule data */
#define SGL_KEYED_INVALIDATE 0x4F
#define SC_INVALID_NS 0x00B
#define SC_DNR 0x4000
#define CDW12_FUA (1u << 30)

/* Latency buckets, as engine/latency.py: upper bounds 2^(i/4) us for i = 0..104, then +Inf (index 105). */
#define NQ_LAT_STEPS_PER_OCTAVE 4
#define NQ_NO_CHUNK UINT32_MAX
#define NQ_LAT_BOUNDS (26 * NQ_LAT_STEPS_PER_OCTAVE + 1)
#define NQ_LAT_BUCKETS (NQ_LAT_BOUNDS + 1)
enum nq_lat_kind { NQ_LAT_READ = 0, NQ_LAT_WRITE = 1 };

enum nq_kind { NQ_RAM = 1, NQ_NULL = 2, NQ_FILE = 3 };

enum nq_state {
    NQ_FREE = 0,
    NQ_NEED_READ,     /* a Write waits for a send-queue entry and an RDMA READ credit (read_wait) */
    NQ_READING,       /* its RDMA READ is posted */
    NQ_NEED_RESPONSE, /* waits for the send-queue entries of its (WRITE and) SEND (send_wait) */
    NQ_COMPLETING,    /* posted; FREE once a send completion retires it */
    NQ_NEED_CHUNK,    /* a file/block Read or Write waits for one of the queue's bounce chunks */
    NQ_NEED_FILE,     /* a file/block Read or Write waits for room in its namespace's depth (file_wait) */
    NQ_FILE_IO,       /* its read or write is on the queue's io_uring */
    NQ_HANDED_BACK,   /* a poll group's file command mailed to the core: its slot and chunk kept until drained */
};

#define NQ_STATES (NQ_HANDED_BACK + 1)
#define NQ_TO(s) (1u << (s))

/* The request lifecycle, as the Python side's NEXT (transport/rdma/requests.py): the states each may move to.
 * Every move goes through nq_move; the test builds (-DNQ_CHECKED, make test-native) abort on any other. */
static const uint16_t nq_next[NQ_STATES] __attribute__((unused)) = {
    /* a command taken: a RAM Write's READ to post, a response to post (Read, Flush, in-capsule Write), a file
     * command's chunk to wait for, or its ring command to start (a Read, or a Write's data in the capsule) */
    [NQ_FREE] = NQ_TO(NQ_NEED_READ) | NQ_TO(NQ_NEED_RESPONSE) | NQ_TO(NQ_NEED_CHUNK) | NQ_TO(NQ_NEED_FILE),
    [NQ_NEED_CHUNK] = NQ_TO(NQ_NEED_READ) | NQ_TO(NQ_NEED_FILE),
    /* its READ posted, or its namespace left the view meanwhile: Invalid Namespace */
    [NQ_NEED_READ] = NQ_TO(NQ_READING) | NQ_TO(NQ_NEED_RESPONSE),
    /* the data is in: the response (RAM), the ring's write (file), or Invalid Namespace */
    [NQ_READING] = NQ_TO(NQ_NEED_RESPONSE) | NQ_TO(NQ_NEED_FILE),
    [NQ_NEED_FILE] = NQ_TO(NQ_FILE_IO),
    /* the ring's answer: the response; a failure handed to the core (mailed, or its slot let go at once); or the
     * queue closed and the reap let it go */
    [NQ_FILE_IO] = NQ_TO(NQ_NEED_RESPONSE) | NQ_TO(NQ_HANDED_BACK) | NQ_TO(NQ_FREE),
    [NQ_NEED_RESPONSE] = NQ_TO(NQ_COMPLETING),
    [NQ_COMPLETING] = NQ_TO(NQ_FREE),  /* a send completion retired it */
    [NQ_HANDED_BACK] = NQ_TO(NQ_FREE), /* the loop drained it */
};

#ifdef NQ_CHECKED
static __attribute__((cold, noinline, noreturn)) void nq_illegal_move(uint32_t idx, int from, int to)
{
    fprintf(stderr, "csrc/queue.c: request %u moved from state %d to %d, which nq_next does not allow\n", idx, from,
            to);
    abort();
}
#define nq_move(q, r, to)                                                                                      \
    do {                                                                                                      \
        if (!(nq_next[(r)->state] & NQ_TO(to)))                                                               \
            nq_illegal_move((uint32_t)((r) - (q)->reqs), (r)->state, (to));                                   \
        (r)->state = (to);                                                                                    \
    } while (0)
#else
#define nq_move(q, r, to) ((r)->state = (to))
#endif

/* A file or block namespace's descriptor (a dup of the backend's, so the core closing its own never pulls it
 * from under a command on the ring) and the commands it has on the rings of every queue, bounded by its depth
 * (the namespace's io engine depth).  Reference counted: the Python File object holds one, and so does every
 * request between taking its slot and leaving the ring; the descriptor is closed with the last one. */
struct nq_file {
    int fd;
    uint32_t refs;
    uint32_t depth, in_flight, most_in_flight;
    uint64_t submitted;
};

/* The counts are atomic: poll groups' threads (queues of one namespace on several) and the Python side (the
 * File object) change them without a common lock. */
static inline struct nq_file *nq_file_get(struct nq_file *f)
{
    __atomic_fetch_add(&f->refs, 1, __ATOMIC_RELAXED);
    return f;
}

static void nq_file_put(struct nq_file *f)
{
    if (f && __atomic_sub_fetch(&f->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        close(f->fd);
        PyMem_RawFree(f);
    }
}

struct nq_ns {
    uint32_t nsid;
    uint8_t kind;
    uint8_t lbads;
    uint64_t num_blocks;
    char *base; /* RAM: the registered memory; NULL: unused */
    uint32_t lkey;
    struct nq_file *file; /* file/block: its descriptor and depth (the view's File object keeps it) */
    uint64_t gen; /* the namespace's generation (engine/subsystem.py): a new one when it is installed, replaced
                     or its memory changes; a Write whose namespace's generation left the view answers Invalid
                     Namespace, as the Python path */
    uint64_t reads, writes, flushes, bytes_read, bytes_written;
    uint64_t lat[2][NQ_LAT_BUCKETS]; /* successful reads' and writes' latencies (nq_lat_bucket) */
    uint64_t lat_sum_ns[2];
};

/* The read-only view Python installs with set_view; replaced whole, never edited in place. */
struct nq_view {
    int ready;
    int paused;           /* its subsystem is paused (engine/api.py): new commands go to Python, which holds them */
    uint32_t max_transfer;
    int count;
    struct nq_ns *ns;     /* sorted by nsid */
    PyObject *keep;       /* the namespaces' memory owners, alive while the view is */
};

struct nq_req {
    uint8_t state;
    uint8_t opc;
    uint8_t invalidate;
    uint8_t signaled;
    uint16_t cid;
    uint16_t status;
    uint32_t len;
    uint32_t rkey;
    uint64_t raddr;
    char *local;     /* data source (Read) or destination (Write) */
    uint32_t lkey;
    uint64_t ns_gen;
    uint64_t view_seq; /* the queue's view_seq when it arrived: unchanged, so is its namespace */
    uint32_t nsid;
    uint32_t pending_next;
    uint32_t chunk;  /* the bounce chunk it holds (file/block namespaces), NQ_NO_CHUNK if none */
    /* file/block namespaces: the descriptor (a reference), where, FUA, and the SQE (and the in-capsule data's
     * length) to hand the command to the core when the device fails it */
    struct nq_file *file;
    uint64_t offset;
    uint8_t fua;
    uint32_t icd_len;
    uint8_t sqe[NQ_SQE_SIZE];
    uint64_t received_ns; /* CLOCK_MONOTONIC when its capsule's receive completion was polled */
};

enum nq_owner { NQ_OWN_NATIVE = 0, NQ_OWN_PYTHON = 1, NQ_OWN_PYTHON_READ = 2 };

struct nq_sq_entry { /* the send queue, in post order: one entry per posting (1 or 2 work requests) */
    uint64_t wr_id;
    uint32_t wrs;
    uint32_t python; /* enum nq_owner: its entries were counted against the Python side's budget; a Python READ
                        also holds one of the queue's READ credits until it completes */
};

/* A FIFO of requests through nq_req.pending_next; UINT32_MAX = none. */
struct nq_fifo {
    uint32_t head, tail;
};

/* A Python side's RDMA READ waiting for a READ credit (post_read found none free). */
struct nq_py_read {
    uint32_t tag, lkey, length, rkey;
    uint64_t laddr, raddr;
};

typedef struct {
    PyObject_HEAD
    struct ibv_qp *qp;
    struct ibv_cq *send_cq, *recv_cq;
    uint16_t qid;
    int closed;
    int closing;             /* begin_close: no new command; what was posted completes, then the owner closes */
    int close_mailed;        /* a poll group's closing queue told the loop its send queue emptied */
    int in_poll;
    int failed;              /* a work completion failed: nothing more is posted */
    int remote_invalidate;

    /* receives */
    char *recv_base;
    uint32_t recv_lkey, recv_count, recv_size;
    struct ibv_recv_wr *recv_wrs;
    struct ibv_sge *recv_sges;
    uint32_t *repost;
    uint32_t nrepost;

    /* request slots and what they wait for */
    struct nq_req *reqs;
    uint32_t nreqs;
    uint32_t *free_stack;
    uint32_t nfree;
    /* one FIFO per resource waited for (SPDK's pending_rdma_read_queue / pending_rdma_write_queue): a request
     * needing only send-queue entries never waits behind one needing a READ credit or namespace depth */
    struct nq_fifo send_wait; /* NQ_NEED_RESPONSE: send-queue entries */
    struct nq_fifo read_wait; /* NQ_NEED_READ: a READ credit (and a send-queue entry) */
    struct nq_fifo file_wait; /* NQ_NEED_FILE: room in its namespace's depth */

    /* the send queue: native budget, READ credits, the log of what is on it */
    uint32_t sq_size;
    uint32_t native_slots, native_slots_total;
    uint32_t reads_free;   /* the host's RDMA READ credits, the native side's and the Python side's READs alike */
    struct nq_py_read *py_reads; /* the Python side's READs waiting for a credit, a ring of python_send */
    uint32_t py_reads_head, py_reads_count, py_reads_size;
    struct nq_sq_entry *sq_log;
    uint32_t sq_head, sq_count;
    uint32_t unsignaled;

    /* this batch's send work requests, posted by one ibv_post_send */
    struct ibv_send_wr *batch;
    struct ibv_sge *batch_sges;
    uint8_t (*batch_cqe)[NQ_CQE_SIZE];
    uint32_t nbatch;
    uint32_t batch_first_response; /* the responses queued in this batch, for selective signaling */
    uint32_t *batch_resp;
    uint32_t nbatch_resp;

    /* SQ head pointer of the CQEs (set with the view once the queue is connected) */
    int sqhd_on;
    int sqflow_disabled;
    uint16_t sqhd, sq_entries;

    char *zero_base; uint32_t zero_lkey; uint32_t zero_len;   /* null namespaces' reads */
    char *sink_base; uint32_t sink_lkey; uint32_t sink_len;   /* null namespaces' writes */

    struct nq_view *view;
    uint64_t view_seq; /* set_view calls so far */

    /* file and block namespaces: the queue's io_uring, and its bounce chunks (registered; fewer than the request
     * slots when memory is short: a command then waits for one, NQ_NEED_CHUNK) */
    struct nr_uring *ring;
    struct nr_uring_done *ring_done;
    char *bounce_base;
    uint32_t bounce_lkey, bounce_chunk;
    uint32_t *chunk_free;       /* a stack of the free chunks' numbers */
    uint32_t nchunks, nchunks_free;
    /* the commands waiting for a chunk, FIFO through nq_req.pending_next: apart from the FIFO of the others, which
     * may hold the very responses whose completions give chunks back */
    uint32_t chunk_wait_head, chunk_wait_tail;
    uint64_t chunk_waits;       /* file commands that found every chunk taken */
    uint32_t ring_queued;       /* on the ring, not yet submitted: one nr_uring_submit per poll */
    uint32_t ring_most_in_flight;
    char *rebuild;              /* a failed in-capsule write's capsule, made again for the core */
    uint64_t file_ios, file_handed_back, ring_submits;

    PyObject *on_capsule, *on_send_done, *on_failure;
    PyObject *error_type, *error_value, *error_tb; /* a callback raised during a poll: re-raised after it */

    struct ibv_wc wc[NQ_POLL_BATCH];
    uint64_t polled_ns; /* CLOCK_MONOTONIC when the completions being handled were polled */

    /* figures */
    uint64_t native_commands, python_commands, doorbells, recv_doorbells, polls;

    /* a poll group's queue (csrc/pollgroup.c): its thread polls under `lock`, the Python side's calls take it
     * too; what needs Python goes on `mail` instead of being called */
    int threaded;      /* set once, by the Python side, before the thread sees the queue */
    int stopped;       /* the group let it go: nothing is polled or posted */
    pthread_mutex_t lock;
    struct nq_mailbox mail;
    struct nq_mail *drained; /* drain's copy of the mailbox, mail.size entries */
    struct nt_ring *trace;   /* the per-command trace (csrc/trace.h), NULL while it is off */
} NativeQueue;

/* ------------------------------------------------------------------ the view */

static void nq_view_free(struct nq_view *view)
{
    if (!view)
        return;
    Py_XDECREF(view->keep);
    PyMem_Free(view->ns);
    PyMem_Free(view);
}

static struct nq_ns *nq_lookup(struct nq_view *view, uint32_t nsid)
{
    int lo = 0, hi = view->count - 1;
    while (lo <= hi) {
        int mid = (lo + hi) >> 1;
        uint32_t got = view->ns[mid].nsid;
        if (got == nsid)
            return &view->ns[mid];
        if (got < nsid)
            lo = mid + 1;
        else
            hi = mid - 1;
    }
    return NULL;
}

/* ------------------------------------------------------------------ latency */

/* The bucket bounds in ns, floor(1000 * 2^(i/4)): latency <= bound[i] us  <=>  ns <= this (ns is an integer).
 * Filled once when the module loads; per command the bucket is a binary search of integers. */
static uint64_t nq_lat_bound_ns[NQ_LAT_BOUNDS];

static void nq_lat_init(void)
{
    static const double root2[NQ_LAT_STEPS_PER_OCTAVE] = {1.0, 1.189207115002721, 1.4142135623730951,
                                                         1.6817928305074290}; /* 2^(k/4) */
    for (int i = 0; i < NQ_LAT_BOUNDS; i++)
        nq_lat_bound_ns[i] = (uint64_t)(1000.0 * root2[i % NQ_LAT_STEPS_PER_OCTAVE] *
                                        (double)(1ULL << (i / NQ_LAT_STEPS_PER_OCTAVE)));
}

static inline uint64_t nq_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* The first bucket whose bound is >= ns, or +Inf. */
static inline uint32_t nq_lat_bucket(uint64_t ns)
{
    uint32_t lo = 0, hi = NQ_LAT_BOUNDS;
    while (lo < hi) {
        uint32_t mid = (lo + hi) >> 1;
        if (ns <= nq_lat_bound_ns[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* ------------------------------------------------------------------ posting */

static inline void nq_fifo_push(NativeQueue *q, struct nq_fifo *f, uint32_t idx)
{
    q->reqs[idx].pending_next = UINT32_MAX;
    if (f->tail == UINT32_MAX)
        f->head = idx;
    else
        q->reqs[f->tail].pending_next = idx;
    f->tail = idx;
}

static inline uint32_t nq_fifo_pop(NativeQueue *q, struct nq_fifo *f)
{
    uint32_t idx = f->head;
    f->head = q->reqs[idx].pending_next;
    if (f->head == UINT32_MAX)
        f->tail = UINT32_MAX;
    return idx;
}

/* Back at the head: it was popped, and still waits. */
static inline void nq_fifo_unpop(NativeQueue *q, struct nq_fifo *f, uint32_t idx)
{
    q->reqs[idx].pending_next = f->head;
    f->head = idx;
    if (f->tail == UINT32_MAX)
        f->tail = idx;
}

static inline void nq_sq_push(NativeQueue *q, uint64_t wr_id, uint32_t wrs, uint32_t python)
{
    struct nq_sq_entry *e = &q->sq_log[(q->sq_head + q->sq_count) % q->sq_size];
    e->wr_id = wr_id;
    e->wrs = wrs;
    e->python = python;
    q->sq_count++;
}

static inline struct ibv_send_wr *nq_batch_wr(NativeQueue *q, uint64_t wr_id, enum ibv_wr_opcode op, int flags,
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

static inline void nq_stamp_sqhd(NativeQueue *q, uint8_t *cqe)
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
static inline void nq_batch_response(NativeQueue *q, uint64_t wr_id, const uint8_t *cqe, uint64_t laddr,
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

/* A native request's response: its CQE built here (success, or the status it carries). */
static inline void nq_queue_response(NativeQueue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    uint8_t cqe[NQ_CQE_SIZE];
    memset(cqe, 0, 8);
    cqe[8] = cqe[9] = 0;
    cqe[10] = q->qid & 0xFF;
    cqe[11] = q->qid >> 8;
    cqe[12] = r->cid & 0xFF;
    cqe[13] = r->cid >> 8;
    uint16_t wire = (uint16_t)(r->status << 1);
    cqe[14] = wire & 0xFF;
    cqe[15] = wire >> 8;
    uint32_t wrs = r->len && r->opc == OPC_READ && !r->status ? 2 : 1;
    q->native_slots -= wrs;
    nq_sq_push(q, idx, wrs, NQ_OWN_NATIVE);
    nq_move(q, r, NQ_COMPLETING);
    if (wrs == 2)
        nq_batch_response(q, idx, cqe, (uintptr_t)r->local, r->lkey, r->len, r->raddr, r->rkey,
                          r->invalidate && q->remote_invalidate, r->rkey);
    else
        nq_batch_response(q, idx, cqe, 0, 0, 0, r->raddr, r->rkey, r->invalidate && q->remote_invalidate, r->rkey);
}

static inline void nq_chunk_take(NativeQueue *q, struct nq_req *r)
{
    r->chunk = q->chunk_free[--q->nchunks_free];
    r->local = q->bounce_base + (size_t)r->chunk * q->bounce_chunk;
}

/* A file/block Read or Write onto the ring when its namespace has room (its depth); submitted at the poll's end. */
static inline int nq_file_start(NativeQueue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    struct nq_file *f = r->file;
    /* Full: wait for a completion on this queue's ring, which wakes this queue (its eventfd).  A queue with
     * nothing on its ring would wait for other queues' completions, which do not wake it: it starts one anyway,
     * so a namespace has at most depth + (queues - 1) commands on the device. */
    if (__atomic_load_n(&f->in_flight, __ATOMIC_RELAXED) >= f->depth && nr_uring_in_flight(q->ring))
        return 0;
    int rc;
    if (r->opc == OPC_READ)
        rc = nr_uring_read(q->ring, f->fd, r->local, r->len, r->offset, idx);
    else if (r->fua)
        rc = nr_uring_write_fua(q->ring, f->fd, r->local, r->len, r->offset, idx);
    else
        rc = nr_uring_write(q->ring, f->fd, r->local, r->len, r->offset, idx);
    if (rc < 0)
        return 0; /* -EBUSY cannot happen (the ring has a place per slot): wait, as for a full namespace */
    q->ring_queued++;
    __atomic_fetch_add(&f->submitted, 1, __ATOMIC_RELAXED);
    uint32_t now = __atomic_add_fetch(&f->in_flight, 1, __ATOMIC_RELAXED);
    uint32_t most = __atomic_load_n(&f->most_in_flight, __ATOMIC_RELAXED);
    while (now > most && !__atomic_compare_exchange_n(&f->most_in_flight, &most, now, 1, __ATOMIC_RELAXED,
                                                       __ATOMIC_RELAXED))
        ;
    unsigned on_ring = nr_uring_in_flight(q->ring);
    if (on_ring > q->ring_most_in_flight)
        q->ring_most_in_flight = on_ring;
    nq_move(q, r, NQ_FILE_IO);
    return 1;
}

/* The request's namespace in the view, as it was when the command arrived (same generation), or NULL. */
static inline struct nq_ns *nq_ns_of(NativeQueue *q, const struct nq_req *r)
{
    struct nq_ns *ns = q->view ? nq_lookup(q->view, r->nsid) : NULL;
    return ns && ns->gen == r->ns_gen ? ns : NULL;
}

/* The view changed while a Write waited for its READ: if its namespace left the view or changed generation, its
 * destination may be memory that is no longer the namespace's, so no READ is posted and it answers Invalid
 * Namespace (as io._write_data).  1 when it does. */
static __attribute__((cold, noinline)) int nq_check_write_target(NativeQueue *q, struct nq_req *r)
{
    if (nq_ns_of(q, r))
        return 0;
    if (r->file) {
        nq_file_put(r->file);
        r->file = NULL;
    }
    r->status = SC_INVALID_NS | SC_DNR;
    nq_move(q, r, NQ_NEED_RESPONSE);
    return 1;
}

/* A Python side's RDMA READ onto this batch, with one of the queue's READ credits. */
static inline void nq_post_py_read(NativeQueue *q, const struct nq_py_read *p)
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

/* The Python side's READs that waited for a credit, oldest first (they go before the native ones waiting). */
static void nq_py_reads_post(NativeQueue *q)
{
    while (q->py_reads_count && q->reads_free) {
        nq_post_py_read(q, &q->py_reads[q->py_reads_head]);
        q->py_reads_head = (q->py_reads_head + 1) % q->py_reads_size;
        q->py_reads_count--;
    }
}

static inline struct nq_fifo *nq_wait_of(NativeQueue *q, uint8_t state)
{
    return state == NQ_NEED_READ ? &q->read_wait : state == NQ_NEED_FILE ? &q->file_wait : &q->send_wait;
}

static inline void nq_advance(NativeQueue *q, uint32_t idx);

/* The request's next step from the state it waits in, as SPDK's nvmf_rdma_request_process: 1 when it moved (posted,
 * started on the ring, or moved on to wait for something else), 0 when what it needs is not there. */
static inline int nq_process(NativeQueue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    switch (r->state) {
    case NQ_NEED_FILE: /* room in its namespace's depth: onto the ring */
        return nq_file_start(q, idx);
    case NQ_NEED_READ: { /* a READ credit and a send-queue entry: its RDMA READ */
        if (__builtin_expect(r->view_seq != q->view_seq, 0) && nq_check_write_target(q, r)) {
            nq_advance(q, idx); /* now it waits for its response's entry only */
            return 1;
        }
        if (!q->native_slots || !q->reads_free || q->py_reads_count)
            return 0;
        q->native_slots--;
        q->reads_free--;
        nq_sq_push(q, idx, 1, NQ_OWN_NATIVE);
        nq_move(q, r, NQ_READING);
        struct ibv_send_wr *w = nq_batch_wr(q, idx, IBV_WR_RDMA_READ, IBV_SEND_SIGNALED, (uintptr_t)r->local,
                                            r->len, r->lkey);
        w->wr.rdma.remote_addr = r->raddr;
        w->wr.rdma.rkey = r->rkey;
        NT_TRACE(q->trace, nt_record, NT_DATA_POSTED, r->cid, r->opc, r->nsid, 0, r->len, r->raddr, r->rkey,
                 NT_FLAG_RDMA_READ);
        return 1;
    }
    case NQ_NEED_RESPONSE: { /* the send-queue entries of its (data WRITE and) SEND */
        uint32_t wrs = r->len && r->opc == OPC_READ && !r->status ? 2 : 1;
        if (q->native_slots < wrs)
            return 0;
        nq_queue_response(q, idx);
        return 1;
    }
    default: /* not a waiting state: what moves it on is an event (a completion, the loop's drain) */
#ifdef NQ_CHECKED
        fprintf(stderr, "csrc/queue.c: request %u processed in state %d, which waits for nothing\n", idx, r->state);
        abort();
#endif
        return 1;
    }
}

/* Move a request on, behind the older ones waiting for the same resource (only those). */
static inline void nq_advance(NativeQueue *q, uint32_t idx)
{
    struct nq_fifo *wait = nq_wait_of(q, q->reqs[idx].state);
    if (wait->head != UINT32_MAX || !nq_process(q, idx))
        nq_fifo_push(q, wait, idx);
}

static void nq_resume_fifo(NativeQueue *q, struct nq_fifo *wait)
{
    while (wait->head != UINT32_MAX) {
        uint32_t idx = nq_fifo_pop(q, wait); /* first: a step may put it on another FIFO */
        if (!nq_process(q, idx)) {
            nq_fifo_unpop(q, wait, idx);
            return;
        }
    }
}

/* Every waiting request that can move now: responses first (their completions give resources back), then the
 * READs (the Python side's before the native ones), then the file commands. */
static void nq_resume(NativeQueue *q)
{
    nq_resume_fifo(q, &q->send_wait);
    nq_py_reads_post(q);
    nq_resume_fifo(q, &q->read_wait);
    nq_resume_fifo(q, &q->file_wait);
}

static void nq_fail(NativeQueue *q, int status, uint64_t wr_id);

/* A successful Read's or Write's latency, from its receive completion to its response's post, into its namespace's
 * histogram (as engine/io.py records the Python path's). */
static inline void nq_record_latency(NativeQueue *q, const struct nq_req *r, uint64_t now)
{
    if (r->status || (r->opc != OPC_READ && r->opc != OPC_WRITE) || !q->view)
        return;
    struct nq_ns *ns = nq_ns_of(q, r);
    if (!ns)
        return; /* its namespace left the view meanwhile */
    int kind = r->opc == OPC_READ ? NQ_LAT_READ : NQ_LAT_WRITE;
    uint64_t took = now > r->received_ns ? now - r->received_ns : 0;
    ns->lat[kind][nq_lat_bucket(took)]++;
    ns->lat_sum_ns[kind] += took;
}

/* Post this batch: the receives first (before any response of them, protocol.md §3.5), then every send work
 * request in one ibv_post_send; every SIGNAL_EVERY-th response and the last signaled (all once the native
 * send-queue entries run low). */
static void nq_flush(NativeQueue *q)
{
    if (q->closed || q->failed) {
        q->nrepost = q->nbatch = q->nbatch_resp = 0;
        return;
    }
    if (q->nrepost) {
        for (uint32_t i = 0; i < q->nrepost; i++)
            q->recv_wrs[q->repost[i]].next = i + 1 < q->nrepost ? &q->recv_wrs[q->repost[i + 1]] : NULL;
        struct ibv_recv_wr *bad_recv;
        int rc = ibv_post_recv(q->qp, &q->recv_wrs[q->repost[0]], &bad_recv);
        q->recv_doorbells++;
        q->nrepost = 0;
        if (rc) {
            nq_fail(q, -rc, 0);
            q->nbatch = q->nbatch_resp = 0;
            return;
        }
    }
    if (!q->nbatch)
        return;
    int low = q->native_slots < q->native_slots_total / 4;
    uint64_t now = 0;
    for (uint32_t k = 0; k < q->nbatch_resp; k++) {
        struct ibv_send_wr *s = &q->batch[q->batch_resp[k]];
        if (s->wr_id & NQ_TAG_PY)
            continue; /* the Python side chose its own signaling (and records its own latencies) */
        if (!now)
            now = nq_now_ns(); /* once per batch: its responses are posted together */
        nq_record_latency(q, &q->reqs[s->wr_id & NQ_TAG_MASK], now);
        q->unsignaled++;
        if (k == q->nbatch_resp - 1 || low || q->unsignaled >= NQ_SIGNAL_EVERY) {
            s->send_flags |= IBV_SEND_SIGNALED;
            q->unsignaled = 0;
        }
    }
    if (__builtin_expect(q->closing, 0)) /* its completion tells the owner the send queue has emptied */
        q->batch[q->nbatch - 1].send_flags |= IBV_SEND_SIGNALED;
    for (uint32_t i = 0; i + 1 < q->nbatch; i++)
        q->batch[i].next = &q->batch[i + 1];
    struct ibv_send_wr *bad;
    int rc = ibv_post_send(q->qp, q->batch, &bad);
    q->doorbells++;
    q->nbatch = q->nbatch_resp = 0;
    if (rc)
        nq_fail(q, -rc, 0);
}

/* ------------------------------------------------------------------ Python hand-over */

static void nq_keep_error(NativeQueue *q)
{
    if (q->error_type) { /* the first one is what the caller sees */
        PyErr_Clear();
        return;
    }
    PyErr_Fetch(&q->error_type, &q->error_value, &q->error_tb);
}

static void nq_call(NativeQueue *q, PyObject *callable, PyObject *args)
{
    if (!args) {
        nq_keep_error(q);
        return;
    }
    PyObject *res = PyObject_CallObject(callable, args);
    Py_DECREF(args);
    if (!res)
        nq_keep_error(q);
    else
        Py_DECREF(res);
}

static void nq_fail(NativeQueue *q, int status, uint64_t wr_id)
{
    if (q->failed)
        return;
    q->failed = status ? status : -1;
    if (q->threaded) /* the mailbox keeps a place for it */
        nq_mailbox_push(&q->mail, NQ_MAIL_FAILURE, (uint32_t)status, wr_id);
    else if (q->on_failure != Py_None)
        nq_call(q, q->on_failure, Py_BuildValue("(iK)", status, (unsigned long long)wr_id));
}

/* A capsule for the core, called with it (on the event loop's thread, holding the GIL). */
static void nq_capsule_to_python(NativeQueue *q, const char *capsule, uint32_t len)
{
    q->python_commands++;
    nq_call(q, q->on_capsule, Py_BuildValue("(y#)", capsule, (Py_ssize_t)len));
}

/* A received capsule for the core.  A poll group's queue mails it with its receive slot, which is re-posted when
 * the loop drains it (so the mailbox holds at most recv_count capsules and never copies one). */
static void nq_to_python(NativeQueue *q, uint32_t slot, uint32_t len)
{
    if (q->threaded) {
        q->python_commands++;
        q->nrepost--; /* nq_capsule queued this slot's re-post last */
        if (nq_mailbox_push(&q->mail, NQ_MAIL_CAPSULE, slot, len) < 0)
            nq_fail(q, -ENOSPC, 0);
        return;
    }
    nq_capsule_to_python(q, q->recv_base + (size_t)slot * q->recv_size, len);
}

/* ------------------------------------------------------------------ per command */

static inline uint32_t rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t rd64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

/* A capsule arrived in receive slot `slot`: the whole command here, or handed to Python. */
static void nq_capsule(NativeQueue *q, uint32_t slot, uint32_t len)
{
    const uint8_t *sqe = (const uint8_t *)q->recv_base + (size_t)slot * q->recv_size;
    NT_TRACE(q->trace, nt_record_capsule, NT_RECEIVED, sqe, len);
    q->repost[q->nrepost++] = slot;
    struct nq_view *view = q->view;
    if (len < NQ_SQE_SIZE || !view || !view->ready || view->paused || !q->nfree)
        goto python;
    uint8_t opc = sqe[0], flags = sqe[1];
    if (opc > OPC_READ || (flags & FLAGS_FUSE_MASK) ||
        ((flags & FLAGS_PSDT_MASK) != PSDT_SGL_CONTIG && (flags & FLAGS_PSDT_MASK) != PSDT_SGL_SGL))
        goto python;
    uint8_t sgl_id = sqe[39];
    int in_capsule = sgl_id == SGL_IN_CAPSULE;
    if (sgl_id != SGL_KEYED && sgl_id != SGL_KEYED_INVALIDATE && !(in_capsule && opc == OPC_WRITE))
        goto python;
    struct nq_ns *ns = nq_lookup(view, rd32(sqe + 4));
    if (!ns)
        goto python;
    uint32_t sgl_len = in_capsule ? rd32(sqe + 32) : (uint32_t)(sqe[32] | (sqe[33] << 8) | (sqe[34] << 16));
    if (in_capsule) { /* the data came with the capsule: within this queue's in-capsule size and what arrived */
        uint64_t at = rd64(sqe + 24), end = at + sgl_len;
        if (at > q->recv_size || end > q->recv_size - NQ_SQE_SIZE || NQ_SQE_SIZE + end > len)
            goto python;
    }
    char *local = NULL;
    uint32_t lkey = 0;
    uint64_t offset = 0;
    if (opc == OPC_FLUSH) {
        /* A file/block Flush goes to the core (its namespace's fdatasync, one at a time per namespace).  Every
         * Write this queue acknowledged before the Flush arrived had completed on the ring before its response
         * was posted, so it is in the file (page cache or device) by then, and the core's fdatasync on the same
         * file covers it. */
        if (sgl_len || ns->kind == NQ_FILE)
            goto python;
    } else {
        uint32_t nlb = (rd32(sqe + 48) & 0xFFFF) + 1;
        uint64_t slba = rd64(sqe + 40);
        if (sgl_len != ((uint64_t)nlb << ns->lbads) || sgl_len > view->max_transfer ||
            slba >= ns->num_blocks || nlb > ns->num_blocks - slba)
            goto python;
        offset = slba << ns->lbads;
        if (ns->kind == NQ_RAM) {
            local = ns->base + offset;
            lkey = ns->lkey;
        } else if (ns->kind == NQ_FILE) {
            /* in-capsule data is copied into a chunk now (its receive is re-posted at the poll's end): with every
             * chunk taken, the core takes the command */
            if (!q->ring || sgl_len > q->bounce_chunk || (in_capsule && !q->nchunks_free))
                goto python;
            lkey = q->bounce_lkey; /* a bounce chunk, taken below or once one is free */
        } else if (opc == OPC_READ) {
            if (sgl_len > q->zero_len)
                goto python;
            local = q->zero_base;
            lkey = q->zero_lkey;
        } else {
            if (sgl_len > q->sink_len)
                goto python;
            local = q->sink_base;
            lkey = q->sink_lkey;
        }
    }
    if (in_capsule && ns->kind != NQ_FILE) { /* data in the capsule: copied now, answered without a transfer */
        if (ns->kind == NQ_RAM)
            memcpy(local, sqe + NQ_SQE_SIZE + rd64(sqe + 24), sgl_len);
        ns->writes++;
        ns->bytes_written += sgl_len;
        sgl_len = 0; /* its response carries no data */
    }
    uint32_t idx = q->free_stack[--q->nfree];
    struct nq_req *r = &q->reqs[idx];
    r->opc = opc;
    r->cid = sqe[2] | (sqe[3] << 8);
    r->status = 0;
    r->len = sgl_len;
    r->raddr = rd64(sqe + 24);
    r->rkey = rd32(sqe + 35);
    r->invalidate = sgl_id == SGL_KEYED_INVALIDATE && sgl_len;
    r->local = local;
    r->lkey = lkey;
    r->nsid = ns->nsid;
    r->ns_gen = ns->gen;
    r->view_seq = q->view_seq;
    r->received_ns = q->polled_ns;
    r->chunk = NQ_NO_CHUNK;
    q->native_commands++;
    if (ns->kind == NQ_FILE) {
        r->file = nq_file_get(ns->file);
        r->offset = offset;
        r->fua = opc == OPC_WRITE && (rd32(sqe + 48) & CDW12_FUA);
        r->icd_len = 0;
        memcpy(r->sqe, sqe, NQ_SQE_SIZE);
        q->file_ios++;
        if (in_capsule) { /* into a bounce chunk: the receive buffer is re-posted at the poll's end */
            nq_chunk_take(q, r);
            r->icd_len = sgl_len;
            memcpy(r->local, sqe + NQ_SQE_SIZE + rd64(sqe + 24), sgl_len);
            nq_move(q, r, NQ_NEED_FILE);
        } else if (q->nchunks_free) {
            nq_chunk_take(q, r);
            nq_move(q, r, opc == OPC_WRITE ? NQ_NEED_READ : NQ_NEED_FILE);
        } else { /* every chunk taken: the next one given back is its (nq_release) */
            r->local = NULL;
            nq_move(q, r, NQ_NEED_CHUNK);
            r->pending_next = UINT32_MAX;
            if (q->chunk_wait_tail == UINT32_MAX)
                q->chunk_wait_head = idx;
            else
                q->reqs[q->chunk_wait_tail].pending_next = idx;
            q->chunk_wait_tail = idx;
            q->chunk_waits++;
            return;
        }
        nq_advance(q, idx);
        return;
    }
    if (opc == OPC_WRITE && !in_capsule) {
        nq_move(q, r, NQ_NEED_READ);
    } else {
        if (opc == OPC_READ) {
            ns->reads++;
            ns->bytes_read += sgl_len;
        } else if (opc == OPC_FLUSH) {
            ns->flushes++;
        }
        nq_move(q, r, NQ_NEED_RESPONSE);
    }
    nq_advance(q, idx);
    return;
python:
    NT_TRACE(q->trace, nt_record_capsule, NT_TO_CORE, sqe, len);
    nq_to_python(q, slot, len);
}

static inline void nq_release(NativeQueue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    uint32_t chunk = r->chunk;
    r->chunk = NQ_NO_CHUNK;
    nq_move(q, r, NQ_FREE);
    q->free_stack[q->nfree++] = idx;
    if (chunk == NQ_NO_CHUNK)
        return;
    q->chunk_free[q->nchunks_free++] = chunk;
    uint32_t next = q->chunk_wait_head;
    if (next == UINT32_MAX)
        return;
    /* the oldest command waiting for a chunk takes it and moves on */
    q->chunk_wait_head = q->reqs[next].pending_next;
    if (q->chunk_wait_head == UINT32_MAX)
        q->chunk_wait_tail = UINT32_MAX;
    struct nq_req *w = &q->reqs[next];
    nq_chunk_take(q, w);
    nq_move(q, w, w->opc == OPC_WRITE ? NQ_NEED_READ : NQ_NEED_FILE);
    nq_advance(q, next);
}

/* A Write's data is in: count it (or answer Invalid Namespace when its namespace left meanwhile), respond. */
static inline void nq_read_done(NativeQueue *q, uint32_t idx)
{
    struct nq_req *r = &q->reqs[idx];
    NT_TRACE(q->trace, nt_record, NT_DATA_DONE, r->cid, r->opc, r->nsid, 0, r->len, 0, 0, 0);
    q->reads_free++;
    struct nq_ns *ns = nq_ns_of(q, r);
    if (r->file) {
        if (!ns) { /* left meanwhile: not written, as io._write_data */
            nq_file_put(r->file);
            r->file = NULL;
            r->status = SC_INVALID_NS | SC_DNR;
            nq_move(q, r, NQ_NEED_RESPONSE);
        } else {
            nq_move(q, r, NQ_NEED_FILE); /* now the file write */
        }
        nq_advance(q, idx);
        return;
    }
    if (!ns) {
        r->status = SC_INVALID_NS | SC_DNR;
    } else {
        ns->writes++;
        ns->bytes_written += r->len;
    }
    nq_move(q, r, NQ_NEED_RESPONSE);
    nq_advance(q, idx);
}

/* A handed-back command's capsule as it arrived: its SQE, or (in-capsule data) rebuilt in q->rebuild from its
 * chunk.  Valid until the request's slot is taken again or the next rebuild. */
static const char *nq_handback_capsule(NativeQueue *q, uint32_t idx, uint32_t *len)
{
    struct nq_req *r = &q->reqs[idx];
    *len = NQ_SQE_SIZE;
    if (!r->icd_len)
        return (const char *)r->sqe;
    uint64_t at = rd64(r->sqe + 24); /* checked against the receive size when it arrived */
    memcpy(q->rebuild, r->sqe, NQ_SQE_SIZE);
    memset(q->rebuild + NQ_SQE_SIZE, 0, at);
    memcpy(q->rebuild + NQ_SQE_SIZE + at, r->local, r->icd_len);
    *len = NQ_SQE_SIZE + (uint32_t)at + r->icd_len;
    return q->rebuild;
}

/* A file/block command the device failed (-errno) or cut short: the core does it again from its capsule, through
 * its own engine, and answers with its own status, error log entry and retries (O_DIRECT refusing an unaligned
 * access, RWF_DSYNC unsupported, the rest of a short transfer) - so an error is the Python path's by construction.
 * Doing it again cannot do harm: a Read has no effect, and a Write not yet acknowledged writes the same bytes to
 * the same blocks (the host may not assume anything of their contents until it is answered); the core fetches
 * the data again from the host (its buffer is the host's until the response) or from the rebuilt capsule. */
static void nq_file_hand_back(NativeQueue *q, uint32_t idx)
{
    q->file_handed_back++;
    NT_TRACE(q->trace, nt_record_capsule, NT_TO_CORE, q->reqs[idx].sqe, NQ_SQE_SIZE);
    if (q->threaded) { /* the loop takes it with what it drains; the capsule is made there */
        q->python_commands++;
        nq_move(q, &q->reqs[idx], NQ_HANDED_BACK);
        if (nq_mailbox_push(&q->mail, NQ_MAIL_HANDBACK, idx, 0) < 0)
            nq_fail(q, -ENOSPC, 0);
        return;
    }
    uint32_t len;
    const char *capsule = nq_handback_capsule(q, idx, &len);
    nq_release(q, idx);
    nq_capsule_to_python(q, capsule, len);
}

/* The ring finished a file/block command: its response, or the core takes it over. */
static void nq_file_done(NativeQueue *q, uint32_t idx, int res)
{
    if (q->closed || idx >= q->nreqs || q->reqs[idx].state != NQ_FILE_IO)
        return; /* closed by a callback during this reap (the ring is gone), or not ours (cookies are slots) */
    struct nq_req *r = &q->reqs[idx];
    NT_TRACE(q->trace, nt_record, NT_DATA_DONE, r->cid, r->opc, r->nsid, 0, (uint32_t)res, 0, 0, NT_FLAG_FILE);
    __atomic_fetch_sub(&r->file->in_flight, 1, __ATOMIC_RELAXED);
    nq_file_put(r->file);
    r->file = NULL;
    if (res < 0 || (uint32_t)res != r->len) {
        nq_file_hand_back(q, idx);
        return;
    }
    struct nq_ns *ns = nq_ns_of(q, r);
    if (r->opc == OPC_READ) {
        if (ns) {
            ns->reads++;
            ns->bytes_read += r->len;
        }
    } else if (!ns) {
        r->status = SC_INVALID_NS | SC_DNR; /* removed while it was written: as io._write_done */
    } else {
        ns->writes++;
        ns->bytes_written += r->len;
    }
    if (r->icd_len)
        r->len = 0; /* a Write's response carries no data */
    nq_move(q, r, NQ_NEED_RESPONSE);
    nq_advance(q, idx);
}

/* Every completion the ring has: the number. */
static int nq_ring_reap(NativeQueue *q)
{
    if (!q->ring)
        return 0;
    int total = 0, n;
    do {
        n = nr_uring_reap(q->ring, q->ring_done, (int)q->nreqs);
        for (int i = 0; i < n; i++)
            nq_file_done(q, (uint32_t)q->ring_done[i].cookie, q->ring_done[i].res);
        total += n > 0 ? n : 0;
    } while (n == (int)q->nreqs && q->ring && !q->closed);
    return total;
}

/* One io_uring_enter for everything queued on the ring this poll.  A failed submit (the kernel short of memory)
 * leaves them queued: the next poll tries again. */
static void nq_ring_submit(NativeQueue *q)
{
    if (!q->ring_queued)
        return;
    int n = nr_uring_submit(q->ring);
    q->ring_submits++;
    if (n > 0)
        q->ring_queued = (uint32_t)n >= q->ring_queued ? 0 : q->ring_queued - (uint32_t)n;
}

/* A signaled send completion: it and everything posted before it are done (RC completes in order). */
static void nq_send_done(NativeQueue *q, uint64_t wr_id)
{
    while (q->sq_count) {
        struct nq_sq_entry e = q->sq_log[q->sq_head];
        q->sq_head = (q->sq_head + 1) % q->sq_size;
        q->sq_count--;
        if (e.python == NQ_OWN_NATIVE) {
            uint32_t idx = (uint32_t)(e.wr_id & NQ_TAG_MASK);
            q->native_slots += e.wrs;
            struct nq_req *r = &q->reqs[idx];
            if (r->state == NQ_READING) {
                if (e.wr_id == wr_id)
                    nq_read_done(q, idx);
                else
                    q->reads_free++; /* cannot happen on RC (a READ is signaled): never hang on it */
            } else if (r->state == NQ_COMPLETING) {
                NT_TRACE(q->trace, nt_record, NT_RESPONSE_DONE, r->cid, r->opc, r->nsid, r->status, 0, 0, 0, 0);
                nq_release(q, idx);
            }
        } else if (e.python == NQ_OWN_PYTHON_READ) {
            q->reads_free++; /* and its completion goes to the Python side below */
        }
        if (e.python != NQ_OWN_NATIVE && e.wr_id == wr_id && q->on_send_done != Py_None) {
            if (!q->threaded)
                nq_call(q, q->on_send_done, Py_BuildValue("(K)", (unsigned long long)(wr_id & NQ_TAG_MASK)));
            else if (nq_mailbox_push(&q->mail, NQ_MAIL_SEND_DONE, 0, wr_id & NQ_TAG_MASK) < 0)
                nq_fail(q, -ENOSPC, wr_id);
        }
        if (e.wr_id == wr_id)
            break;
    }
}

static void nq_completion(NativeQueue *q, struct ibv_wc *wc)
{
    if (wc->status != IBV_WC_SUCCESS) {
        nq_fail(q, wc->status, wc->wr_id);
        return;
    }
    if ((wc->wr_id & (NQ_TAG_RECV | NQ_TAG_PY)) == NQ_TAG_RECV) {
        if (!q->closing) /* a closing queue takes no new command, nor re-posts its receive */
            nq_capsule(q, (uint32_t)(wc->wr_id & NQ_TAG_MASK), wc->byte_len);
    }
    else
        nq_send_done(q, wc->wr_id);
}

/* One poll: up to `budget` completions, NQ_POLL_BATCH per ibv_poll_cq, then one flush. */
__attribute__((noinline)) static int nq_poll(NativeQueue *q, int budget)
{
    int done = 0;
    q->in_poll = 1;
    q->polls++;
    if (q->ring && !q->closed && !q->failed)
        done += nq_ring_reap(q); /* file/block commands the device finished: their responses */
    while (done < budget && !q->closed && !q->failed) {
        int n = ibv_poll_cq(q->recv_cq, NQ_POLL_BATCH, q->wc);
        if (n < 0) {
            nq_fail(q, n, 0);
            break;
        }
        if (n)
            q->polled_ns = nq_now_ns(); /* once per batch: the receives' arrival, for the latency histograms */
        for (int i = 0; i < n && !q->closed && !q->failed; i++)
            nq_completion(q, &q->wc[i]);
        int m = 0;
        if (q->send_cq != q->recv_cq && !q->closed && !q->failed) {
            m = ibv_poll_cq(q->send_cq, NQ_POLL_BATCH, q->wc);
            if (m < 0) {
                nq_fail(q, m, 0);
                break;
            }
            for (int i = 0; i < m && !q->closed && !q->failed; i++)
                nq_completion(q, &q->wc[i]);
        }
        done += n + m;
        if (n < NQ_POLL_BATCH && m < NQ_POLL_BATCH)
            break;
    }
    if (!q->closed && !q->failed)
        nq_resume(q);
    /* One submission for the file/block commands this poll started; a read the page cache holds completes
     * inside it, so its response joins this batch instead of waiting for the eventfd (a few rounds at most). */
    for (int round = 0; round < 4 && q->ring_queued && !q->closed && !q->failed; round++) {
        nq_ring_submit(q);
        int n = nq_ring_reap(q);
        if (!n)
            break;
        done += n;
        nq_resume(q);
    }
    nq_flush(q);
    q->in_poll = 0;
    return done;
}

/* ------------------------------------------------------------------ a poll group's queue */

static PyObject *nq_reraise(NativeQueue *q);

/* The Python side's calls on a poll group's queue hold its mutex (waiting for it without the GIL: the poll thread
 * never takes the GIL, so neither waits on the other). */
static inline void nq_lock(NativeQueue *q)
{
    if (!q->threaded || pthread_mutex_trylock(&q->lock) == 0)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&q->lock);
    Py_END_ALLOW_THREADS
}

static inline void nq_unlock(NativeQueue *q)
{
    if (q->threaded)
        pthread_mutex_unlock(&q->lock);
}

int native_queue_poll_threaded(void *queue, int budget)
{
    NativeQueue *q = queue;
    int done = 0;
    pthread_mutex_lock(&q->lock);
    if (!q->stopped && !q->closed && !q->failed)
        done = nq_poll(q, budget);
    if (q->closing && !q->close_mailed && !q->sq_count && !q->stopped) { /* the mailbox keeps a place for it */
        q->close_mailed = 1;
        nq_mailbox_push(&q->mail, NQ_MAIL_CLOSE_READY, 0, 0);
    }
    if (!q->stopped)
        nq_mailbox_wake(&q->mail);
    pthread_mutex_unlock(&q->lock);
    return done;
}

void native_queue_stop(void *queue)
{
    NativeQueue *q = queue;
    nq_lock(q);
    q->stopped = 1;
    nq_unlock(q);
}

static PyTypeObject NativeQueueType;

int native_queue_check(void *obj)
{
    return PyObject_TypeCheck((PyObject *)obj, &NativeQueueType);
}

int native_queue_attach(void *queue)
{
    NativeQueue *q = queue;
    if (q->threaded) {
        PyErr_SetString(PyExc_RuntimeError, "the queue already belongs to a poll group");
        return -1;
    }
    if (q->closed || !q->reqs) {
        PyErr_SetString(PyExc_ConnectionError, "the native queue is closed");
        return -1;
    }
    /* every capsule it can hold back (one per receive), every file command handed back (one per request slot),
     * every signaled send of the Python side, a failure, a closing queue's end */
    uint32_t size = q->recv_count + q->nreqs + q->sq_size + 3;
    if (nq_mailbox_init(&q->mail, size) < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    q->drained = PyMem_Calloc(size, sizeof *q->drained);
    if (!q->drained) {
        nq_mailbox_free(&q->mail);
        PyErr_NoMemory();
        return -1;
    }
    pthread_mutex_init(&q->lock, NULL);
    q->threaded = 1;
    return q->mail.fd;
}

/* drain(): what the poll thread mailed, delivered in order to on_capsule / on_send_done / on_failure; the
 * capsules' receives are re-posted first (one doorbell, before any response of them).  Returns how many. */
static PyObject *NativeQueue_drain(NativeQueue *q, PyObject *noargs)
{
    if (!q->threaded)
        return PyLong_FromLong(0);
    nq_lock(q);
    nq_mailbox_clear_wake(&q->mail);
    uint32_t n = q->stopped || q->closed ? 0 : q->mail.count;
    PyObject *capsules = PyTuple_New(n);
    if (!capsules) {
        nq_unlock(q);
        return NULL;
    }
    for (uint32_t i = 0; i < n; i++) {
        struct nq_mail *e = &q->mail.ring[(q->mail.head + i) % q->mail.size];
        q->drained[i] = *e;
        PyObject *bytes;
        if (e->kind == NQ_MAIL_CAPSULE) {
            bytes = PyBytes_FromStringAndSize(q->recv_base + (size_t)e->a * q->recv_size, (Py_ssize_t)e->b);
        } else if (e->kind == NQ_MAIL_HANDBACK) {
            uint32_t len;
            const char *capsule = nq_handback_capsule(q, e->a, &len);
            bytes = PyBytes_FromStringAndSize(capsule, (Py_ssize_t)len);
        } else {
            continue;
        }
        if (!bytes) { /* left in the mailbox: the next drain tries again */
            nq_unlock(q);
            Py_DECREF(capsules);
            return NULL;
        }
        PyTuple_SET_ITEM(capsules, i, bytes);
    }
    /* every capsule made: the receives are re-posted, the handed-back commands' slots and chunks let go */
    for (uint32_t i = 0; i < n; i++) {
        if (q->drained[i].kind == NQ_MAIL_CAPSULE)
            q->repost[q->nrepost++] = q->drained[i].a;
        else if (q->drained[i].kind == NQ_MAIL_HANDBACK)
            nq_release(q, q->drained[i].a);
    }
    q->mail.head = (q->mail.head + n) % q->mail.size;
    q->mail.count = 0;
    nq_flush(q);
    nq_unlock(q);
    for (uint32_t i = 0; i < n; i++) {
        struct nq_mail *e = &q->drained[i];
        if (e->kind == NQ_MAIL_CAPSULE || e->kind == NQ_MAIL_HANDBACK)
            nq_call(q, q->on_capsule, PyTuple_Pack(1, PyTuple_GET_ITEM(capsules, i)));
        else if (e->kind == NQ_MAIL_SEND_DONE)
            nq_call(q, q->on_send_done, Py_BuildValue("(K)", (unsigned long long)e->b));
        else if (e->kind == NQ_MAIL_FAILURE && q->on_failure != Py_None)
            nq_call(q, q->on_failure, Py_BuildValue("(iK)", (int)e->a, (unsigned long long)e->b));
    }
    Py_DECREF(capsules);
    if (q->error_type)
        return nq_reraise(q);
    return PyLong_FromUnsignedLong(n);
}


/* ------------------------------------------------------------------ the Python types */

/* _native.File(fd, depth): a file or block namespace's descriptor for the native view (a dup, closed with the
 * last reference) and its depth; in_flight / most_in_flight are its commands on the queues' rings. */
typedef struct {
    PyObject_HEAD
    struct nq_file *file;
} NativeFile;

static int NativeFile_init(NativeFile *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "depth", NULL};
    int fd;
    unsigned int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iI", kwlist, &fd, &depth))
        return -1;
    if (self->file) {
        PyErr_SetString(PyExc_RuntimeError, "a File is initialised once");
        return -1;
    }
    if (fd < 0 || depth == 0 || depth > 4096) {
        PyErr_Format(PyExc_ValueError, "File(fd, depth): fd %d must be open, depth %u 1..4096", fd, depth);
        return -1;
    }
    struct nq_file *f = PyMem_RawCalloc(1, sizeof *f);
    if (!f) {
        PyErr_NoMemory();
        return -1;
    }
    f->fd = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (f->fd < 0) {
        PyMem_RawFree(f);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    f->refs = 1;
    f->depth = depth;
    self->file = f;
    return 0;
}

static void NativeFile_dealloc(NativeFile *self)
{
    nq_file_put(self->file);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *NativeFile_status(NativeFile *self, PyObject *noargs)
{
    struct nq_file *f = self->file;
    if (!f)
        return PyDict_New();
    return Py_BuildValue("{sIsIsIsK}", "depth", f->depth, "in_flight", __atomic_load_n(&f->in_flight,
                         __ATOMIC_RELAXED), "most_in_flight", __atomic_load_n(&f->most_in_flight, __ATOMIC_RELAXED),
                         "submitted", (unsigned long long)__atomic_load_n(&f->submitted, __ATOMIC_RELAXED));
}

static PyMethodDef NativeFile_methods[] = {
    {"status", (PyCFunction)NativeFile_status, METH_NOARGS,
     "{depth, in_flight, most_in_flight, submitted}: its commands on the native queues' rings."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject NativeFileType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nvmeof_roce._native.File",
    .tp_basicsize = sizeof(NativeFile),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A file or block namespace's descriptor and depth, for the native view (docs/native.md).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)NativeFile_init,
    .tp_dealloc = (destructor)NativeFile_dealloc,
    .tp_methods = NativeFile_methods,
};

static int nq_ptr(PyObject *obj, void **out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (PyErr_Occurred())
        return 0;
    *out = (void *)(uintptr_t)v;
    return 1;
}

static int nq_region(PyObject *obj, char **base, uint32_t *lkey, uint32_t *len)
{
    if (obj == Py_None) {
        *base = NULL;
        *lkey = *len = 0;
        return 1;
    }
    unsigned long long addr;
    unsigned int key, length;
    if (!PyArg_ParseTuple(obj, "KII", &addr, &key, &length))
        return 0;
    *base = (char *)(uintptr_t)addr;
    *lkey = key;
    *len = length;
    return 1;
}

/* The ring's commands complete (nr_uring_destroy waits: the kernel may write the bounce chunks until then), then
 * the requests' references to their files are let go. */
static void nq_files_close(NativeQueue *q)
{
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
    }
    q->ring_queued = 0;
}

/* A closed queue's ring, without waiting: what the kernel finished is reaped (its requests let go of their files),
 * what it still holds is cancelled where it can be; once nothing is left the ring is freed.  Returns the commands
 * still in the kernel: until they come back the kernel may write the bounce chunks, which the owner keeps. */
static unsigned nq_closed_reap(NativeQueue *q)
{
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
                nq_move(q, r, NQ_FREE);
            }
        }
        unsigned left = nr_uring_in_flight(q->ring);
        if (left)
            return left;
        nr_uring_destroy(q->ring); /* nothing in flight: it does not wait */
        q->ring = NULL;
    }
    for (uint32_t i = 0; q->reqs && i < q->nreqs; i++) { /* the requests not on the ring */
        if (q->reqs[i].file) {
            nq_file_put(q->reqs[i].file);
            q->reqs[i].file = NULL;
        }
    }
    q->ring_queued = 0;
    return 0;
}

static void NativeQueue_dealloc(NativeQueue *q)
{
    if (q->threaded) { /* a poll group holds a reference while it polls: none polls it now */
        nq_mailbox_free(&q->mail);
        PyMem_Free(q->drained);
        pthread_mutex_destroy(&q->lock);
    }
    nq_files_close(q);
    PyMem_Free(q->ring_done);
    PyMem_Free(q->rebuild);
    PyMem_Free(q->chunk_free);
    nq_view_free(q->view);
    PyMem_Free(q->recv_wrs);
    PyMem_Free(q->recv_sges);
    PyMem_Free(q->repost);
    PyMem_Free(q->reqs);
    PyMem_Free(q->free_stack);
    PyMem_Free(q->sq_log);
    PyMem_Free(q->py_reads);
    PyMem_Free(q->batch);
    PyMem_Free(q->batch_sges);
    PyMem_Free(q->batch_cqe);
    PyMem_Free(q->batch_resp);
    Py_XDECREF(q->on_capsule);
    Py_XDECREF(q->on_send_done);
    Py_XDECREF(q->on_failure);
    Py_XDECREF(q->error_type);
    Py_XDECREF(q->error_value);
    Py_XDECREF(q->error_tb);
    nt_ring_free(q->trace);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

static int NativeQueue_init(NativeQueue *q, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"qp", "send_cq", "recv_cq", "qid", "recv", "recv_count", "recv_size", "requests",
                             "send_queue", "python_send", "reads", "on_capsule", "on_send_done", "on_failure",
                             "zero", "sink", "remote_invalidate", NULL};
    PyObject *qp, *scq, *rcq, *recv = NULL, *on_capsule = NULL, *on_send_done = Py_None, *on_failure = Py_None;
    PyObject *zero = Py_None, *sink = Py_None;
    unsigned int qid = 0, recv_count = 0, recv_size = 0, nreqs = 0, sq_size = 0, python_send = 0, reads = 0;
    int remote_invalidate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|$IOIIIIIIOOOOOp", kwlist, &qp, &scq, &rcq, &qid, &recv,
                                     &recv_count, &recv_size, &nreqs, &sq_size, &python_send, &reads, &on_capsule,
                                     &on_send_done, &on_failure, &zero, &sink, &remote_invalidate))
        return -1;
    if (!recv || !on_capsule) {
        PyErr_SetString(PyExc_TypeError, "recv and on_capsule are required");
        return -1;
    }
    if (q->reqs) {
        PyErr_SetString(PyExc_RuntimeError, "a native queue is initialised once");
        return -1;
    }
    void *p;
    if (!nq_ptr(qp, &p)) return -1;
    q->qp = p;
    if (!nq_ptr(scq, &p)) return -1;
    q->send_cq = p;
    if (!nq_ptr(rcq, &p)) return -1;
    q->recv_cq = p;
    if (!q->qp || !q->send_cq || !q->recv_cq) {
        PyErr_SetString(PyExc_ValueError, "qp, send_cq and recv_cq must be the addresses of verbs objects");
        return -1;
    }
    uint32_t recv_len;
    if (!nq_region(recv, &q->recv_base, &q->recv_lkey, &recv_len) ||
        !nq_region(zero, &q->zero_base, &q->zero_lkey, &q->zero_len) ||
        !nq_region(sink, &q->sink_base, &q->sink_lkey, &q->sink_len))
        return -1;
    if (!recv_count || recv_size < NQ_SQE_SIZE || (uint64_t)recv_count * recv_size > recv_len || !nreqs ||
        python_send >= sq_size || !reads || nreqs >= (1u << 31)) {
        PyErr_Format(PyExc_ValueError, "native queue: recv_count %u x recv_size %u must fit the %u-byte receive "
                     "region (recv_size >= 64), requests > 0, python_send < send_queue, reads > 0",
                     recv_count, recv_size, recv_len);
        return -1;
    }
    if (!PyCallable_Check(on_capsule)) {
        PyErr_SetString(PyExc_TypeError, "on_capsule must be callable");
        return -1;
    }
    q->qid = (uint16_t)qid;
    q->recv_count = recv_count;
    q->recv_size = recv_size;
    q->nreqs = nreqs;
    q->sq_size = sq_size;
    q->native_slots = q->native_slots_total = sq_size - python_send;
    q->reads_free = reads;
    q->remote_invalidate = remote_invalidate;
    q->send_wait.head = q->send_wait.tail = UINT32_MAX;
    q->read_wait.head = q->read_wait.tail = UINT32_MAX;
    q->file_wait.head = q->file_wait.tail = UINT32_MAX;
    q->py_reads_size = python_send ? python_send : 1;
    q->recv_wrs = PyMem_Calloc(recv_count, sizeof *q->recv_wrs);
    q->recv_sges = PyMem_Calloc(recv_count, sizeof *q->recv_sges);
    q->repost = PyMem_Calloc(recv_count, sizeof *q->repost);
    q->reqs = PyMem_Calloc(nreqs, sizeof *q->reqs);
    q->free_stack = PyMem_Calloc(nreqs, sizeof *q->free_stack);
    q->sq_log = PyMem_Calloc(sq_size, sizeof *q->sq_log);
    q->py_reads = PyMem_Calloc(q->py_reads_size, sizeof *q->py_reads);
    q->batch = PyMem_Calloc(sq_size, sizeof *q->batch);
    q->batch_sges = PyMem_Calloc(sq_size, sizeof *q->batch_sges);
    q->batch_cqe = PyMem_Calloc(sq_size, sizeof *q->batch_cqe);
    q->batch_resp = PyMem_Calloc(sq_size, sizeof *q->batch_resp);
    if (!q->recv_wrs || !q->recv_sges || !q->repost || !q->reqs || !q->free_stack || !q->sq_log || !q->py_reads ||
        !q->batch ||
        !q->batch_sges || !q->batch_cqe || !q->batch_resp) {
        PyErr_NoMemory();
        return -1;
    }
    for (uint32_t i = 0; i < recv_count; i++) {
        q->recv_sges[i].addr = (uintptr_t)(q->recv_base + (size_t)i * recv_size);
        q->recv_sges[i].length = recv_size;
        q->recv_sges[i].lkey = q->recv_lkey;
        q->recv_wrs[i].wr_id = NQ_TAG_RECV | i;
        q->recv_wrs[i].sg_list = &q->recv_sges[i];
        q->recv_wrs[i].num_sge = 1;
        q->repost[i] = i;
    }
    for (uint32_t i = 0; i < nreqs; i++)
        q->free_stack[i] = nreqs - 1 - i;
    q->nfree = nreqs;
    Py_INCREF(on_capsule);
    q->on_capsule = on_capsule;
    Py_INCREF(on_send_done);
    q->on_send_done = on_send_done;
    Py_INCREF(on_failure);
    q->on_failure = on_failure;
    /* every receive posted (one doorbell) before the connection is accepted */
    q->nrepost = recv_count;
    nq_flush(q);
    if (q->failed) {
        PyErr_Format(PyExc_OSError, "posting the receives failed (%d)", q->failed);
        return -1;
    }
    return 0;
}

static PyObject *nq_reraise(NativeQueue *q)
{
    if (!q->error_type)
        return NULL;
    PyErr_Restore(q->error_type, q->error_value, q->error_tb);
    q->error_type = q->error_value = q->error_tb = NULL;
    return NULL;
}

/* METH_FASTCALL: no argument tuple is allocated per poll */
static PyObject *NativeQueue_poll(NativeQueue *q, PyObject *const *args, Py_ssize_t nargs)
{
    int budget = 256;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "poll(budget=256) takes at most one argument");
        return NULL;
    }
    if (nargs == 1) {
        budget = (int)PyLong_AsLong(args[0]);
        if (budget == -1 && PyErr_Occurred())
            return NULL;
    }
    if (q->threaded) { /* first: in_poll is the thread's */
        PyErr_SetString(PyExc_RuntimeError, "a poll group's thread polls this queue: drain() its mailbox");
        return NULL;
    }
    if (q->in_poll) {
        PyErr_SetString(PyExc_RuntimeError, "poll() called from inside a poll");
        return NULL;
    }
    int done = q->closed ? 0 : nq_poll(q, budget);
    if (q->error_type)
        return nq_reraise(q);
    return PyLong_FromLong(done);
}

static PyObject *NativeQueue_arm(NativeQueue *q, PyObject *noargs)
{
    if (q->closed || q->threaded) /* a poll group's queue is polled, never armed */
        Py_RETURN_NONE;
    int rc = ibv_req_notify_cq(q->recv_cq, 0);
    if (!rc && q->send_cq != q->recv_cq)
        rc = ibv_req_notify_cq(q->send_cq, 0);
    if (rc) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyObject *nq_check_posting(NativeQueue *q)
{
    if (q->closed || q->failed || q->stopped) {
        PyErr_SetString(PyExc_ConnectionError, "the native queue is closed");
        return NULL;
    }
    return Py_None;
}

/* post_read(tag, local_addr, lkey, length, remote_addr, rkey): the Python side's RDMA READ, signaled.  It takes
 * one of the queue's READ credits (the host granted them to the QP, not to either side), or waits in the queue
 * for the next one given back. */
static PyObject *nq_post_read(NativeQueue *q, PyObject *args)
{
    struct nq_py_read p;
    unsigned long long laddr, raddr;
    if (!PyArg_ParseTuple(args, "IKIIKI", &p.tag, &laddr, &p.lkey, &p.length, &raddr, &p.rkey))
        return NULL;
    p.laddr = laddr;
    p.raddr = raddr;
    if (!nq_check_posting(q))
        return NULL;
    if (q->sq_count + q->py_reads_count >= q->sq_size || q->nbatch >= q->sq_size ||
        (q->py_reads_count == q->py_reads_size && !q->reads_free)) {
        PyErr_SetString(PyExc_OverflowError, "the send queue is full: the Python side overran its share");
        return NULL;
    }
    if (q->reads_free && !q->py_reads_count) {
        nq_post_py_read(q, &p);
        if (!q->in_poll)
            nq_flush(q);
    } else {
        q->py_reads[(q->py_reads_head + q->py_reads_count++) % q->py_reads_size] = p;
    }
    Py_RETURN_NONE;
}

/* post_response(tag, cqe, signaled, data_addr, lkey, length, remote_addr, rkey, invalidate): the Python side's
 * response: its data WRITE (when length) chained before the inline SEND of the 16-byte CQE; invalidate is the
 * host's key to invalidate with it, or -1. */
static PyObject *nq_post_response(NativeQueue *q, PyObject *args)
{
    unsigned int tag, lkey, length, rkey;
    unsigned long long laddr, raddr;
    int signaled;
    long long invalidate;
    Py_buffer cqe;
    if (!PyArg_ParseTuple(args, "Iy*pKIIKIL", &tag, &cqe, &signaled, &laddr, &lkey, &length, &raddr, &rkey,
                          &invalidate))
        return NULL;
    if (cqe.len != NQ_CQE_SIZE) {
        PyBuffer_Release(&cqe);
        return PyErr_Format(PyExc_ValueError, "a response is %d bytes, not %zd", NQ_CQE_SIZE, cqe.len);
    }
    if (!nq_check_posting(q)) {
        PyBuffer_Release(&cqe);
        return NULL;
    }
    uint32_t wrs = length ? 2 : 1;
    if (q->sq_count >= q->sq_size || q->nbatch + wrs > q->sq_size) {
        PyBuffer_Release(&cqe);
        PyErr_SetString(PyExc_OverflowError, "the send queue is full: the Python side overran its share");
        return NULL;
    }
    nq_sq_push(q, NQ_TAG_PY | tag, wrs, NQ_OWN_PYTHON);
    nq_batch_response(q, NQ_TAG_PY | tag, cqe.buf, laddr, lkey, length, raddr, rkey,
                      invalidate >= 0 && q->remote_invalidate, (uint32_t)invalidate);
    PyBuffer_Release(&cqe);
    if (signaled)
        q->batch[q->nbatch - 1].send_flags |= IBV_SEND_SIGNALED;
    if (!q->in_poll)
        nq_flush(q);
    Py_RETURN_NONE;
}

/* enable_files(bounce, chunk) -> the ring's eventfd: file and block namespaces may be in the view from now on.
 * bounce: (addr, lkey, length) of registered memory, page aligned (O_DIRECT), cut into chunks of `chunk` bytes: at
 * least one, at most one per request slot (more are not used); the ring has a place per slot. */
static PyObject *nq_enable_files(NativeQueue *q, PyObject *args)
{
    PyObject *bounce;
    unsigned int chunk;
    if (!PyArg_ParseTuple(args, "OI", &bounce, &chunk))
        return NULL;
    if (q->closed)
        return PyErr_Format(PyExc_ConnectionError, "the native queue is closed");
    if (q->ring)
        return PyErr_Format(PyExc_RuntimeError, "enable_files() was called already");
    char *base;
    uint32_t lkey, len;
    if (!nq_region(bounce, &base, &lkey, &len))
        return NULL;
    if (!base || !chunk || chunk % 4096 || (uintptr_t)base % 4096 || chunk > len)
        return PyErr_Format(PyExc_ValueError, "enable_files: chunks of %u bytes (a multiple of 4096, at least one) "
                            "must fit the %u-byte page-aligned bounce region", chunk, len);
    uint32_t nchunks = len / chunk < q->nreqs ? len / chunk : q->nreqs;
    q->ring_done = PyMem_Calloc(q->nreqs, sizeof *q->ring_done);
    q->rebuild = PyMem_Calloc(1, q->recv_size);
    q->chunk_free = PyMem_Calloc(nchunks, sizeof *q->chunk_free);
    if (!q->ring_done || !q->rebuild || !q->chunk_free) {
        PyMem_Free(q->ring_done);
        PyMem_Free(q->rebuild);
        PyMem_Free(q->chunk_free);
        q->ring_done = NULL;
        q->rebuild = NULL;
        q->chunk_free = NULL;
        return PyErr_NoMemory();
    }
    int err = 0;
    q->ring = nr_uring_create(q->nreqs, &err);
    if (!q->ring) {
        errno = -err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    q->bounce_base = base;
    q->bounce_lkey = lkey;
    q->bounce_chunk = chunk;
    for (uint32_t i = 0; i < nchunks; i++)
        q->chunk_free[i] = nchunks - 1 - i; /* chunk 0 on top */
    q->nchunks = q->nchunks_free = nchunks;
    q->chunk_wait_head = q->chunk_wait_tail = UINT32_MAX;
    return PyLong_FromLong(nr_uring_eventfd(q->ring));
}

/* The Python side's calls that post or change what the C queue owns: under the queue's mutex when a poll group's
 * thread polls it. */
#define NQ_LOCKED_METHOD(name, impl)                                                                          \
    static PyObject *name(NativeQueue *q, PyObject *args)                                                     \
    {                                                                                                         \
        nq_lock(q);                                                                                           \
        PyObject *res = impl(q, args);                                                                        \
        nq_unlock(q);                                                                                         \
        return res;                                                                                           \
    }

NQ_LOCKED_METHOD(NativeQueue_enable_files, nq_enable_files)
NQ_LOCKED_METHOD(NativeQueue_post_read, nq_post_read)
NQ_LOCKED_METHOD(NativeQueue_post_response, nq_post_response)

static PyObject *NativeQueue_flush(NativeQueue *q, PyObject *noargs)
{
    nq_lock(q);
    if (!q->in_poll && !q->stopped)
        nq_flush(q);
    nq_unlock(q);
    Py_RETURN_NONE;
}

/* set_view(ready, max_transfer, namespaces, sq_entries=0, sq_head=0, sqflow_disabled=False, paused=False): the
 * one call that changes what the queue serves natively.  namespaces: (nsid, kind "ram"|"null", lbads, num_blocks, addr, lkey,
 * generation, owner) each; owner is kept alive while the view is.  paused: the subsystem is paused, its new
 * commands go to Python (the commands in flight finish against this view).  Returns the outgoing view's figures:
 * {nsid: (reads, writes, flushes, bytes_read, bytes_written, read_latency, write_latency)}, a latency being
 * (sum_ns, ((bucket, count), ...)) with engine/latency.py's buckets. */
/* (sum_ns, ((bucket, count), ...)) of one histogram's non-empty buckets, zeroed; buckets as engine/latency.py. */
static PyObject *nq_drain_latency(struct nq_ns *ns, int kind)
{
    Py_ssize_t used = 0;
    for (int i = 0; i < NQ_LAT_BUCKETS; i++)
        used += ns->lat[kind][i] != 0;
    PyObject *buckets = PyTuple_New(used);
    if (!buckets)
        return NULL;
    Py_ssize_t at = 0;
    for (int i = 0; i < NQ_LAT_BUCKETS; i++) {
        if (!ns->lat[kind][i])
            continue;
        PyObject *pair = Py_BuildValue("(iK)", i, (unsigned long long)ns->lat[kind][i]);
        if (!pair) {
            Py_DECREF(buckets);
            return NULL;
        }
        PyTuple_SET_ITEM(buckets, at++, pair);
    }
    PyObject *out = Py_BuildValue("(KN)", (unsigned long long)ns->lat_sum_ns[kind], buckets);
    if (out) {
        memset(ns->lat[kind], 0, sizeof ns->lat[kind]);
        ns->lat_sum_ns[kind] = 0;
    }
    return out;
}

static PyObject *nq_drain_stats(struct nq_view *view)
{
    PyObject *out = PyDict_New();
    if (!out || !view)
        return out;
    for (int i = 0; i < view->count; i++) {
        struct nq_ns *ns = &view->ns[i];
        PyObject *key = PyLong_FromUnsignedLong(ns->nsid);
        PyObject *read_lat = nq_drain_latency(ns, NQ_LAT_READ), *write_lat = nq_drain_latency(ns, NQ_LAT_WRITE);
        PyObject *val = read_lat && write_lat ? Py_BuildValue("(KKKKKOO)", ns->reads, ns->writes, ns->flushes,
                                                              ns->bytes_read, ns->bytes_written, read_lat,
                                                              write_lat) : NULL;
        Py_XDECREF(read_lat);
        Py_XDECREF(write_lat);
        if (!key || !val || PyDict_SetItem(out, key, val) < 0) {
            Py_XDECREF(key);
            Py_XDECREF(val);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(key);
        Py_DECREF(val);
        ns->reads = ns->writes = ns->flushes = ns->bytes_read = ns->bytes_written = 0;
    }
    return out;
}

static int nq_ns_cmp(const void *a, const void *b)
{
    uint32_t x = ((const struct nq_ns *)a)->nsid, y = ((const struct nq_ns *)b)->nsid;
    return x < y ? -1 : x > y;
}

static PyObject *NativeQueue_set_view(NativeQueue *q, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"ready", "max_transfer", "namespaces", "sq_entries", "sq_head", "sqflow_disabled",
                             "paused", NULL};
    int ready, sqflow_disabled = 0, paused = 0;
    unsigned int max_transfer, sq_entries = 0, sq_head = 0;
    PyObject *list;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "pIO|IIpp", kwlist, &ready, &max_transfer, &list, &sq_entries,
                                     &sq_head, &sqflow_disabled, &paused))
        return NULL;
    PyObject *seq = PySequence_Fast(list, "namespaces must be a sequence of tuples");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    struct nq_view *view = PyMem_Calloc(1, sizeof *view);
    if (!view || !(view->ns = PyMem_Calloc(n ? n : 1, sizeof *view->ns)) || !(view->keep = PyTuple_New(n))) {
        Py_DECREF(seq);
        nq_view_free(view);
        return PyErr_NoMemory();
    }
    view->ready = ready;
    view->paused = paused;
    view->max_transfer = max_transfer;
    view->count = (int)n;
    for (Py_ssize_t i = 0; i < n; i++) {
        struct nq_ns *ns = &view->ns[i];
        const char *kind;
        unsigned int nsid, lbads, lkey;
        unsigned long long num_blocks, addr, gen;
        PyObject *owner, *file = Py_None;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "IsIKKIKO|O;namespace (nsid, kind, lbads, "
                              "num_blocks, addr, lkey, generation, owner[, file])", &nsid, &kind, &lbads,
                              &num_blocks, &addr, &lkey, &gen, &owner, &file))
            goto bad;
        if (!strcmp(kind, "ram"))
            ns->kind = NQ_RAM;
        else if (!strcmp(kind, "null"))
            ns->kind = NQ_NULL;
        else if (!strcmp(kind, "file")) {
            ns->kind = NQ_FILE;
            if (!PyObject_TypeCheck(file, &NativeFileType)) {
                PyErr_Format(PyExc_ValueError, "namespace %u: a file namespace needs its _native.File", nsid);
                goto bad;
            }
            if (!q->ring || max_transfer > q->bounce_chunk) {
                PyErr_Format(PyExc_ValueError, "namespace %u: file namespaces need enable_files() first, with "
                             "bounce chunks of max_transfer (%u) bytes", nsid, max_transfer);
                goto bad;
            }
            ns->file = ((NativeFile *)file)->file;
            owner = file; /* the File keeps the descriptor: it lives as long as the view */
        } else {
            PyErr_Format(PyExc_ValueError, "namespace %u: kind %s is served by Python, not the native view", nsid,
                         kind);
            goto bad;
        }
        if (lbads < 9 || lbads > 16 || !nsid || (ns->kind == NQ_RAM && !addr)) {
            PyErr_Format(PyExc_ValueError, "namespace %u: lbads %u (9..16) and a RAM namespace's address", nsid,
                         lbads);
            goto bad;
        }
        ns->nsid = nsid;
        ns->lbads = (uint8_t)lbads;
        ns->num_blocks = num_blocks;
        ns->base = (char *)(uintptr_t)addr;
        ns->lkey = lkey;
        ns->gen = gen;
        Py_INCREF(owner);
        PyTuple_SET_ITEM(view->keep, i, owner);
    }
    Py_DECREF(seq);
    qsort(view->ns, n, sizeof *view->ns, nq_ns_cmp);
    for (Py_ssize_t i = 1; i < n; i++)
        if (view->ns[i].nsid == view->ns[i - 1].nsid) {
            PyErr_Format(PyExc_ValueError, "namespace %u appears twice in the view", view->ns[i].nsid);
            nq_view_free(view);
            return NULL;
        }
    if (ready && !sqflow_disabled && !sq_entries) {
        PyErr_SetString(PyExc_ValueError, "a ready view needs sq_entries (the SQ size, for SQHD)");
        nq_view_free(view);
        return NULL;
    }
    nq_lock(q);
    PyObject *stats = nq_drain_stats(q->view);
    if (!stats) {
        nq_unlock(q);
        nq_view_free(view);
        return NULL;
    }
    struct nq_view *old = q->view;
    q->view = view;
    q->view_seq++;
    if (ready && !q->sqhd_on) { /* from here on the C queue numbers every CQE, the Python side's too */
        q->sqhd_on = 1;
        q->sqflow_disabled = sqflow_disabled;
        q->sq_entries = (uint16_t)(sq_entries ? sq_entries : 1);
        q->sqhd = (uint16_t)sq_head;
    }
    nq_unlock(q);
    /* A namespace's memory changes only once its commands drained (the engine's pause): no command uses memory
     * the outgoing view alone lists.  Its owners are released here, outside the mutex (a release may run Python
     * code). */
    nq_view_free(old);
    return stats;
bad:
    Py_DECREF(seq);
    nq_view_free(view);
    return NULL;
}

/* in_flight() -> {generation: commands}: the native commands in flight per namespace generation, from taking a
 * slot to their response's completion (a command handed to Python is the core's).  What the engine's pause
 * waits for before a namespace changes (engine/api.py). */
static PyObject *NativeQueue_in_flight(NativeQueue *q, PyObject *noargs)
{
    PyObject *out = PyDict_New();
    if (!out)
        return NULL;
    nq_lock(q);
    for (uint32_t i = 0; i < q->nreqs && !q->closed; i++) {
        const struct nq_req *r = &q->reqs[i];
        if (r->state == NQ_FREE || r->state == NQ_HANDED_BACK)
            continue;
        PyObject *key = PyLong_FromUnsignedLongLong(r->ns_gen);
        PyObject *was = key ? PyDict_GetItemWithError(out, key) : NULL;
        PyObject *now = key && !PyErr_Occurred() ? PyLong_FromLong(was ? PyLong_AsLong(was) + 1 : 1) : NULL;
        int rc = now ? PyDict_SetItem(out, key, now) : -1;
        Py_XDECREF(key);
        Py_XDECREF(now);
        if (rc < 0) {
            nq_unlock(q);
            Py_DECREF(out);
            return NULL;
        }
    }
    nq_unlock(q);
    return out;
}

static PyObject *NativeQueue_take_stats(NativeQueue *q, PyObject *noargs)
{
    nq_lock(q);
    PyObject *res = nq_drain_stats(q->view);
    nq_unlock(q);
    return res;
}

static PyObject *NativeQueue_stats(NativeQueue *q, PyObject *noargs)
{
    nq_lock(q);
    uint32_t busy = q->nreqs - q->nfree;
    PyObject *res = Py_BuildValue("{sKsKsKsKsKsIsIsIsIsisIsIsIsKsKsKsisIsIsIsK}", "native_commands", q->native_commands,
                                  "python_commands", q->python_commands, "doorbells", q->doorbells,
                                  "recv_doorbells", q->recv_doorbells, "polls", q->polls, "native_in_flight", busy,
                                  "native_send_free", q->native_slots, "reads_free", q->reads_free,
                                  "send_queue_used", q->sq_count, "failed", q->failed,
                                  "ring_in_flight", q->ring ? nr_uring_in_flight(q->ring) : 0u,
                                  "ring_most_in_flight", q->ring_most_in_flight, "ring_queued", q->ring_queued,
                                  "file_commands", q->file_ios, "file_handed_back", q->file_handed_back,
                                  "ring_submits", q->ring_submits, "threaded", q->threaded,
                                  "mailed", q->threaded ? q->mail.count : 0, "bounce_chunks", q->nchunks,
                                  "bounce_chunks_free", q->nchunks_free, "chunk_waits", q->chunk_waits);
    nq_unlock(q);
    return res;
}

static PyObject *NativeQueue_close(NativeQueue *q, PyObject *noargs)
{
    /* Call after the QP is destroyed (or in error; a poll group's queue after the group let it go): nothing is
     * posted from here on; the view is released.  Never waits for the ring: returns its commands still in the
     * kernel (reap_closed() until 0; the bounce chunks are the kernel's until then). */
    nq_lock(q);
    q->closed = 1;
    unsigned held = nq_closed_reap(q);
    struct nq_view *old = q->view;
    q->view = NULL;
    q->nbatch = q->nbatch_resp = q->nrepost = 0;
    nq_unlock(q);
    nq_view_free(old);
    return PyLong_FromUnsignedLong(held);
}

/* reap_closed() -> the commands still in the kernel: a closed queue's ring reaped without waiting (on its
 * eventfd), freed when none is left. */
static PyObject *NativeQueue_reap_closed(NativeQueue *q, PyObject *noargs)
{
    nq_lock(q);
    unsigned held = q->closed ? nq_closed_reap(q) : 0;
    nq_unlock(q);
    return PyLong_FromUnsignedLong(held);
}

/* begin_close() -> True while what is posted still has to complete: the responses this poll made (a Disconnect's
 * own among them) are posted now, even inside the poll, and the queue takes no new command from here on; the
 * owner keeps the QP until close_ready, then closes it (nvmet answers the Disconnect, then tears down). */
static PyObject *NativeQueue_begin_close(NativeQueue *q, PyObject *noargs)
{
    nq_lock(q);
    int busy = 0;
    if (!q->closed && !q->failed && !q->stopped) {
        q->closing = 1;
        nq_flush(q);
        busy = !q->failed && q->sq_count > 0;
    }
    nq_unlock(q);
    return PyBool_FromLong(busy);
}

static PyObject *NativeQueue_close_ready(NativeQueue *q, void *closure)
{
    nq_lock(q);
    int ready = q->closed || q->failed || q->stopped || (q->closing && !q->sq_count && !q->nbatch);
    nq_unlock(q);
    return PyBool_FromLong(ready);
}

static PyObject *NativeQueue_closed(NativeQueue *q, void *closure)
{
    nq_lock(q);
    int closed = q->closed || q->failed;
    nq_unlock(q);
    return PyBool_FromLong(closed);
}

static PyObject *NativeQueue_mail_fd(NativeQueue *q, void *closure)
{
    return PyLong_FromLong(q->threaded ? q->mail.fd : -1);
}

NT_QUEUE_METHODS(NativeQueue, trace, q->qp->qp_num, nq_lock, nq_unlock)

static PyMethodDef NativeQueue_methods[] = {
    {"poll", (PyCFunction)(void (*)(void))NativeQueue_poll, METH_FASTCALL,
     "poll(budget=256) -> completions handled; receives re-posted and sends posted once at the end."},
    {"arm", (PyCFunction)NativeQueue_arm, METH_NOARGS, "Request a completion event on the CQs."},
    {"post_read", (PyCFunction)NativeQueue_post_read, METH_VARARGS,
     "post_read(tag, local_addr, lkey, length, remote_addr, rkey): an RDMA READ for the Python side."},
    {"post_response", (PyCFunction)NativeQueue_post_response, METH_VARARGS,
     "post_response(tag, cqe, signaled, data_addr, lkey, length, remote_addr, rkey, invalidate)."},
    {"flush", (PyCFunction)NativeQueue_flush, METH_NOARGS, "Post what is queued (a no-op inside a poll)."},
    {"enable_files", (PyCFunction)NativeQueue_enable_files, METH_VARARGS,
     "enable_files(bounce, chunk) -> eventfd of the queue's io_uring (file and block namespaces in the view)."},
    {"set_view", (PyCFunction)(void (*)(void))NativeQueue_set_view, METH_VARARGS | METH_KEYWORDS,
     "set_view(ready, max_transfer, namespaces, sq_entries=0, sq_head=0, sqflow_disabled=False, paused=False) -> "
     "old figures."},
    {"in_flight", (PyCFunction)NativeQueue_in_flight, METH_NOARGS,
     "in_flight() -> {generation: commands}: native commands in flight per namespace generation."},
    {"take_stats", (PyCFunction)NativeQueue_take_stats, METH_NOARGS,
     "{nsid: (reads, writes, flushes, bytes_read, bytes_written, read_latency, write_latency)} since the last "
     "call; zeroed.  A latency: (sum_ns, ((bucket, count), ...)), buckets as engine/latency.py."},
    {"stats", (PyCFunction)NativeQueue_stats, METH_NOARGS, "The queue's counters."},
    {"close", (PyCFunction)NativeQueue_close, METH_NOARGS,
     "Stop posting (after the QP is gone); never waits: the ring's commands still in the kernel, cancelled where "
     "they can be."},
    {"reap_closed", (PyCFunction)NativeQueue_reap_closed, METH_NOARGS,
     "A closed queue's ring reaped without waiting: the commands still in the kernel (the ring freed at 0)."},
    {"begin_close", (PyCFunction)NativeQueue_begin_close, METH_NOARGS,
     "begin_close() -> True while responses already made are still to leave: posted now, no new command taken."},
    {"drain", (PyCFunction)NativeQueue_drain, METH_NOARGS,
     "A poll group's queue: deliver what its thread mailed (capsules, send completions, a failure); how many."},
    NT_QUEUE_METHOD_DEFS(NativeQueue)
    {NULL, NULL, 0, NULL},
};

static PyObject *NativeQueue_ring_unsubmitted(NativeQueue *q, void *closure)
{
    return PyBool_FromLong(q->ring_queued != 0);
}

static PyGetSetDef NativeQueue_getset[] = {
    {"closed", (getter)NativeQueue_closed, NULL, "closed, or a work completion failed", NULL},
    {"close_ready", (getter)NativeQueue_close_ready, NULL,
     "after begin_close: everything posted has completed (or the queue failed): the owner may close the QP", NULL},
    {"ring_unsubmitted", (getter)NativeQueue_ring_unsubmitted, NULL,
     "commands wait on the ring for a submission that failed (the kernel short of memory): poll again", NULL},
    {"mail_fd", (getter)NativeQueue_mail_fd, NULL, "a poll group's queue: its mailbox eventfd (else -1)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject NativeQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nvmeof_roce._native.Queue",
    .tp_basicsize = sizeof(NativeQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One NVMe/RDMA I/O queue's data path in C (docs/native.md).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)NativeQueue_init,
    .tp_dealloc = (destructor)NativeQueue_dealloc,
    .tp_methods = NativeQueue_methods,
    .tp_getset = NativeQueue_getset,
};

/* latency_bucket(ns): the bucket a command of this latency lands in, for the tests that hold it to
 * engine/latency.py's LatencyHistogram.record_ns. */
static PyObject *nq_latency_bucket_py(PyObject *module, PyObject *arg)
{
    unsigned long long ns = PyLong_AsUnsignedLongLong(arg);
    if (ns == (unsigned long long)-1 && PyErr_Occurred())
        return NULL;
    return PyLong_FromUnsignedLong(nq_lat_bucket(ns));
}

static PyMethodDef nq_module_functions[] = {
    {"latency_bucket", nq_latency_bucket_py, METH_O,
     "latency_bucket(ns) -> the latency histogram bucket of the native data path (engine/latency.py's buckets)."},
    {NULL, NULL, 0, NULL},
};

int native_cm_register(PyObject *module); /* csrc/cm.c: the verbs objects of a native queue */
int native_pollgroup_register(PyObject *module); /* csrc/pollgroup.c */

int native_queue_register(PyObject *module)
{
    if (native_cm_register(module) < 0 || native_pollgroup_register(module) < 0)
        return -1;
    if (PyType_Ready(&NativeQueueType) < 0 || PyType_Ready(&NativeFileType) < 0)
        return -1;
    nq_lat_init();
    if (PyModule_AddFunctions(module, nq_module_functions) < 0)
        return -1;
    Py_INCREF(&NativeFileType);
    if (PyModule_AddObject(module, "File", (PyObject *)&NativeFileType) < 0) {
        Py_DECREF(&NativeFileType);
        return -1;
    }
    Py_INCREF(&NativeQueueType);
    if (PyModule_AddObject(module, "Queue", (PyObject *)&NativeQueueType) < 0) {
        Py_DECREF(&NativeQueueType);
        return -1;
    }
    return PyModule_AddIntConstant(module, "SIGNAL_EVERY", NQ_SIGNAL_EVERY) < 0 ||
           PyModule_AddIntConstant(module, "POLL_BATCH", NQ_POLL_BATCH) < 0 ||
           PyModule_AddIntConstant(module, "LATENCY_BUCKETS", NQ_LAT_BUCKETS) < 0 ? -1 : 0;
}
