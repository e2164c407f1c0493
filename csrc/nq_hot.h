/* The native queue's hot path (csrc/nq_hot.c): plain C, no Python.  One NVMe/RDMA I/O queue's per-command work
 * (docs/native.md); its owner, the CPython type `_native.Queue`, is csrc/nq_type.c. */
#ifndef NVMEOF_ROCE_NQ_HOT_H
#define NVMEOF_ROCE_NQ_HOT_H

#include "backend.h"
#include "mailbox.h"
#include "nq_life.h"
#include "nq_ref.h"
#include "uring.h"

#include <pthread.h>
#include <stdint.h>
#include <infiniband/verbs.h>

struct nt_ring;

#define NQ_POLL_BATCH 32      /* completions per ibv_poll_cq */
#define NQ_SIGNAL_EVERY 16    /* at most this many responses retired by one send completion */
#define NQ_CQE_SIZE 16
#define NQ_SQE_SIZE 64
#define NQ_STAGED_MAX 4  /* staged backend entries one queue serves */

/* wr_id: a receive slot; a native request slot; a work request of the Python side (its book's index). */
#define NQ_TAG_RECV (1ULL << 62)
#define NQ_TAG_PY (1ULL << 63)
#define NQ_TAG_MASK ((1ULL << 32) - 1)
#define NQ_WRITE_WR_ID (NQ_TAG_RECV | NQ_TAG_PY) /* an unsignaled data WRITE: never completes alone */

/* NVMe (docs/protocol.md §2, §6) */
#define OPC_FLUSH 0x00
#define OPC_WRITE 0x01
#define OPC_READ 0x02
#define OPC_WRITE_ZEROES 0x08
#define CDW12_DEAC (1u << 25)
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

enum nq_state {
    NQ_FREE = 0,
    NQ_NEED_READ,     /* a Write waits for a send-queue entry and an RDMA READ credit (read_wait) */
    NQ_READING,       /* its RDMA READ is posted */
    NQ_NEED_RESPONSE, /* waits for the send-queue entries of its (WRITE and) SEND (send_wait) */
    NQ_COMPLETING,    /* posted; FREE once a send completion retires it */
    NQ_NEED_CHUNK,    /* a staged backend's Read or Write waits for one of the queue's bounce chunks */
    NQ_NEED_FILE,     /* a staged backend's command waits for room in its namespace's depth (file_wait) */
    NQ_FILE_IO,       /* on its staged backend (the queue's io_uring): nq_backend_done finishes it */
    NQ_HANDED_BACK,   /* a poll group's file command mailed to the core: its slot and chunk kept until drained */
};

#define NQ_STATES (NQ_HANDED_BACK + 1)
#define NQ_TO(s) (1u << (s))

/* A staged namespace's handle (csrc/backend.h): for the uring entry its descriptor (a dup of the backend's, so
 * the core closing its own never pulls it from under a command on the ring) and the commands it has on the rings of every queue, bounded by its depth
 * (the namespace's io engine depth).  Reference counted: the Python File object holds one, and so does every
 * request between taking its slot and leaving the ring; the descriptor is closed with the last one. */
struct nq_file {
    int fd;
    uint32_t refs;
    void (*release)(struct nq_file *f); /* the last reference let go: this instead of close(fd) + free (RBD) */
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

/* One reference let go; the last closes the descriptor and frees it (allocated with malloc). */
void nq_file_put(struct nq_file *f);

struct nq_ns {
    uint32_t nsid;
    uint8_t lbads;
    uint8_t be_flags; /* ops->flags (NQ_BE_*), read by the per-command path without going through ops */
    uint8_t paused;   /* a change to it waits (engine/api.py): its new commands go to Python, which holds them; it
                         stays listed so the commands in flight still find it */
    const struct nq_backend_ops *ops; /* its backend's entry (csrc/backend.c), named by the view */
    uint64_t num_blocks;
    char *base; /* RAM: the registered memory; NULL: unused */
    uint32_t lkey;
    struct nq_file *file; /* a staged backend's handle: descriptor and depth (the view's File object keeps it) */
    uint64_t gen; /* the namespace's generation (engine/subsystem.py): a new one when it is installed, replaced
                     or its memory changes; a Write whose namespace's generation left the view answers Invalid
                     Namespace, as the Python path */
    struct nq_ref *ref; /* its epoch's reference (csrc/nq_ref.h), which every command served here takes; the view
                           holds it */
    uint64_t reads, writes, flushes, bytes_read, bytes_written;
    uint64_t lat[2][NQ_LAT_BUCKETS]; /* successful reads' and writes' latencies (nq_lat_bucket) */
    uint64_t lat_sum_ns[2];
};

/* The read-only view Python installs with set_view; replaced whole, never edited in place. */
struct nq_view {
    int ready;
    uint32_t max_transfer;
    int count;
    struct nq_ns *ns;     /* sorted by nsid */
    void *keep;           /* the owner's: what keeps the namespaces' memory alive while the view is */
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
    struct nq_ref *ref; /* its namespace's reference, held from its parse until its slot is freed */
    uint64_t view_seq; /* the queue's view_seq when it arrived: unchanged, so is its namespace */
    uint32_t nsid;
    uint32_t pending_next;
    uint32_t chunk;  /* the bounce chunk it holds (staged backends), NQ_NO_CHUNK if none */
    uint32_t op_len; /* Write Zeroes / deallocate through an entry: the bytes from `offset` */
    /* a command served through its entry (not a memory entry's Read or Write, which never reads these): the entry
     * when it arrived; a staged one's also the handle (a reference), where, FUA, and the SQE (and the in-capsule
     * data's length) to hand the command to the core when the device fails it */
    const struct nq_backend_ops *ops;
    struct nq_file *file;
    uint64_t offset;
    uint8_t fua;
    uint32_t icd_len;
    uint8_t sqe[NQ_SQE_SIZE];
    uint64_t received_ns; /* CLOCK_MONOTONIC when its capsule's receive completion was polled */
};

enum nq_owner { NQ_OWN_NATIVE = 0, NQ_OWN_PYTHON = 1, NQ_OWN_PYTHON_READ = 2 };

struct nq_py_read;

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

struct nq_queue;

/* What the hot path hands to its owner (csrc/nq_type.c: the Python core), called from inside nq_poll. */
struct nq_hooks {
    /* a command for the core; handed_back: one the device failed (nq_file_hand_back), started before, not new */
    void (*capsule)(struct nq_queue *q, const char *capsule, uint32_t len, int handed_back);
    void (*send_done)(struct nq_queue *q, uint64_t tag);                 /* a signaled send of the owner's */
    void (*failure)(struct nq_queue *q, int status, uint64_t wr_id);     /* -errno of a post, or a wc status */
};

/* One NVMe/RDMA I/O queue's data path (docs/native.md). */
struct nq_queue {
    struct ibv_qp *qp;
    struct ibv_cq *send_cq, *recv_cq;
    uint16_t qid;
    int state;               /* enum nq_qstate (csrc/nq_life.h), moved by nq_qmove only */
    int in_poll;
    int fail_status;         /* why it failed: -errno of a post, a work completion's status (0: it did not) */
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
    /* the staged backends of the namespaces this queue served (csrc/backend.h): their completions reaped and their
     * queued commands submitted by every poll */
    const struct nq_backend_ops *staged[NQ_STAGED_MAX];
    void *staged_state[NQ_STAGED_MAX]; /* each one's per-queue state (its `attach`), NULL if none */
    uint32_t nstaged;
    uint32_t ring_most_in_flight;
    char *rebuild;              /* a failed in-capsule write's capsule, made again for the core */
    uint64_t file_ios, file_handed_back, ring_submits;

    const struct nq_hooks *hooks;
    int tell_send_done;      /* the owner wants its signaled sends' completions (hooks->send_done, or mailed) */

    struct ibv_wc wc[NQ_POLL_BATCH];
    uint64_t polled_ns; /* CLOCK_MONOTONIC when the completions being handled were polled */

    /* figures */
    uint64_t native_commands, python_commands, doorbells, recv_doorbells, polls;
    /* adaptive polling (nq_poll_adaptive): the spins that found a completion before their bound, the empty polls
     * of a spin (each yielded the CPU), the times the CQs were armed, and the completions the poll after arming
     * found (they raise no event of their own) */
    uint64_t spin_hits, spin_yields, arms, arm_catches;
    uint64_t flushed; /* completions nq_reap_flushed took off the CQs */
    int hook_error;          /* the owner's hook failed during this poll (its error is kept): stop spinning */

    /* a poll group's queue (csrc/pollgroup.c): its thread polls under `lock`, the Python side's calls take it
     * too; what needs Python goes on `mail` instead of being called */
    int threaded;      /* set once, by the Python side, before the thread sees the queue */
    pthread_mutex_t lock;
    struct nq_mailbox mail;
    struct nq_mail *drained; /* drain's copy of the mailbox, mail.size entries */
    struct nt_ring *trace;   /* the per-command trace (csrc/trace.h), NULL while it is off */
};

/* A request lets go of its namespace's reference: when its slot is freed, or when its queue's QP is gone. */
static inline void nq_let_go(struct nq_req *r)
{
    struct nq_ref *ref = r->ref;
    if (ref) {
        r->ref = NULL;
        nq_ref_put(ref);
    }
}

/* Polled and posting (SERVING, CLOSING, CLOSE_READY): the per-command path's one compare. */
static inline int nq_q_live(const struct nq_queue *q)
{
    return q->state < NQ_Q_FAILED;
}

/* Every request not on the ring lets go (a closed queue's, once its QP is gone: none of them can move data). */
static inline void nq_let_go_off_ring(struct nq_queue *q)
{
    for (uint32_t i = 0; q->reqs && i < q->nreqs; i++)
        if (q->reqs[i].state != NQ_FILE_IO || !q->ring)
            nq_let_go(&q->reqs[i]);
}

/* Requests holding namespace reference `ref` (a fence's bound tears down the queues that have some). */
static inline uint32_t nq_holding(const struct nq_queue *q, const struct nq_ref *ref)
{
    uint32_t n = 0;
    for (uint32_t i = 0; q->reqs && i < q->nreqs; i++)
        n += q->reqs[i].ref == ref;
    return n;
}

/* A staged backend entry joins the queue's (its completions reaped by every poll): 0, -ENOSPC when it has
 * NQ_STAGED_MAX already, or its `attach`'s -errno. */
static inline int nq_staged_add(struct nq_queue *q, const struct nq_backend_ops *ops)
{
    for (uint32_t i = 0; i < q->nstaged; i++)
        if (q->staged[i] == ops)
            return 0;
    if (q->nstaged == NQ_STAGED_MAX)
        return -28; /* -ENOSPC */
    if (ops->attach) {
        int rc = ops->attach(q, &q->staged_state[q->nstaged]);
        if (rc < 0)
            return rc;
    }
    q->staged[q->nstaged++] = ops;
    return 0;
}

/* Every staged entry's `closed`: the commands still on their devices (csrc/nq_owner.c nq_closed_reap, csrc/nq_setup.c
 * nq_queue_free with `final`). */
static inline unsigned nq_staged_closed(struct nq_queue *q, int final)
{
    unsigned left = 0;
    for (uint32_t i = 0; i < q->nstaged; i++)
        if (q->staged[i]->closed && q->staged_state[i])
            left += q->staged[i]->closed(q, &q->staged_state[i], final);
    return left;
}

/* The queue's arrays, made once (no allocation per command); every receive posted.  0, or -errno (-ENOMEM, or the
 * ibv_post_recv's). */
struct nq_params {
    struct ibv_qp *qp;
    struct ibv_cq *send_cq, *recv_cq;
    uint16_t qid;
    char *recv_base;
    uint32_t recv_lkey, recv_count, recv_size;
    uint32_t requests, send_queue, python_send, reads;
    char *zero_base; uint32_t zero_lkey, zero_len;
    char *sink_base; uint32_t sink_lkey, sink_len;
    int remote_invalidate;
    const struct nq_hooks *hooks;
    int tell_send_done;
};
int nq_queue_init(struct nq_queue *q, const struct nq_params *p);
/* Its arrays freed; a ring still holding commands is waited for (the last resort: close reaps without waiting). */
void nq_queue_free(struct nq_queue *q);

/* File and block namespaces from now on: the ring and the bounce chunks (registered, page aligned, `chunk` bytes
 * each, at most one per request slot).  0, or -errno. */
int nq_enable_files(struct nq_queue *q, char *base, uint32_t lkey, uint32_t len, uint32_t chunk);

/* One poll: up to `budget` completions, then one doorbell for what they post; the number handled. */
int nq_poll(struct nq_queue *q, int budget);
/* Request a completion event on both CQs (the next completion after this writes the completion channel).  0, or
 * the ibv_req_notify_cq's error. */
int nq_arm(struct nq_queue *q);
/* Adaptive polling (`--poll adaptive`, docs/native.md): poll; after a poll that found work keep polling until
 * `spin_ns` pass without a completion; then arm the CQs and poll once more, since a completion that arrived
 * between the last poll and the arm raises no event (the verbs contract).  Returns the completions handled;
 * *armed is 1 when the CQs were armed (the caller sleeps on the channels), 0 when `budget` was spent first (the
 * caller polls again before sleeping) or the queue closed or failed; *arm_rc the arm's error, if any. */
int nq_poll_adaptive(struct nq_queue *q, int budget, uint64_t spin_ns, int *armed, int *arm_rc);
/* Post what is batched (receives first, then every send). */
void nq_flush(struct nq_queue *q);

/* The owner's posts.  0, or -EOVERFLOW when it overran its share of the send queue.  A READ takes one of the
 * queue's READ credits or waits in the queue for the next one given back. */
struct nq_py_read {
    uint32_t tag, lkey, length, rkey;
    uint64_t laddr, raddr;
};
int nq_post_owner_read(struct nq_queue *q, const struct nq_py_read *p);
int nq_post_owner_response(struct nq_queue *q, uint32_t tag, const uint8_t *cqe, int signaled, uint64_t laddr,
                           uint32_t lkey, uint32_t length, uint64_t raddr, uint32_t rkey, long long invalidate);

/* A mailed (handed back) command's capsule as it arrived; valid until its slot is taken again or the next
 * rebuild.  Then its slot let go. */
const char *nq_handback_capsule(struct nq_queue *q, uint32_t idx, uint32_t *len);
void nq_release(struct nq_queue *q, uint32_t idx);

/* Closing: the responses batched posted now, no new command taken; 1 while posted work has to complete. */
int nq_begin_close(struct nq_queue *q);
int nq_close_ready(const struct nq_queue *q);
/* After the owner put the QP in the error state: what it flushed taken off the CQs, the queue failed; the send
 * work requests not seen within spin_ns (0: all reaped). */
uint32_t nq_reap_flushed(struct nq_queue *q, uint64_t spin_ns);
/* A closed queue's ring without waiting: the commands still in the kernel (the ring freed at 0).  Called once its QP
 * is gone: every command not on the ring lets go of its namespace's reference (nothing of it can move data any
 * more), those on the ring when they come back. */
unsigned nq_closed_reap(struct nq_queue *q);

/* A poll group's thread: poll under the queue's mutex, mail what needs the owner, wake it. */
int nq_poll_threaded(struct nq_queue *q, int budget);

/* The latency histogram bucket of a command that took `ns` (engine/latency.py's buckets); nq_lat_init once. */
void nq_lat_init(void);
uint32_t nq_latency_bucket(uint64_t ns);

#endif
