/* The initiator's native I/O queue: `initiator perf`'s measured loop in C (docs/native.md, "The host queue").
 *
 * Python keeps the CM and the NVMe Connect (transport/rdma/host_native.py): it makes the QP on the connection's
 * CM id (create_host_qp, with librdmacm, on one CQ of our own), registers the memory, and hands the QP, the CQ
 * and the buffers to a HostQueue.  The queue serves the Python initiator's few commands (send/poll: the Connect)
 * and runs `perf` with the GIL released: QD commands in flight, random aligned LBAs, a read/write mix, a keyed SGL
 * into the registered data buffer, the 16-byte responses into a receive ring, each command's latency into a
 * log-linear histogram; one doorbell per poll batch for the SENDs and one for the receives, SENDs signaled every
 * `signal_interval`-th, nothing allocated per I/O.
 *
 * No response is trusted that was not asked for (as nvme_rdma_recv_done): one shorter than a CQE, or one whose CID
 * names no command in flight, is a protocol error that fails the queue (counted in stats(), named in the error);
 * perf's CIDs carry a 4-bit generation above the tag (as the Python initiator's), so a stale or duplicated
 * response cannot complete the command that reused its tag.
 *
 * Wire facts (docs/protocol.md): perf's CID is the tag | generation << 12; PSDT 01b (SGL); the keyed SGL data
 * block descriptor is address (8), length (3), key (4), identifier 0x40 (keyed data block, address subtype: the
 * target does not invalidate the key); the CQE's CID is at byte 12, the status (phase bit 0) at byte 14.
 */
#include "native.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define SQE_SIZE 64
#define CQE_SIZE 16
#define SEND_WR_BASE (1ULL << 63) /* a SEND's wr_id: base | slot << 32 | SENDs it retires; a receive's: its index */
#define NO_SLOT 0xFFFFu
#define MAX_DEPTH 4096 /* a tag fits the CID's low 12 bits */
#define CID_TAG_BITS 12
#define CID_TAG_MASK ((1u << CID_TAG_BITS) - 1)
#define POLL_BATCH 64
#define SUB_BUCKETS 32 /* histogram: 32 buckets per power of two (about 3 % wide) */
#define HIST_BUCKETS (60 * SUB_BUCKETS)
#define EMPTY_POLLS_BEFORE_SLEEP 64 /* hybrid polling: then sleep on the completion channel */
#define SLEEP_MS 100
#define DRAIN_NS 10000000000ULL /* a perf run waits this long for its last commands */

typedef struct {
    PyObject_HEAD
    struct ibv_qp *qp;
    struct ibv_cq *cq;
    struct ibv_comp_channel *channel; /* the CQ's, or NULL: perf only polls */
    uint8_t *recv;     /* recv_count responses of 16 bytes */
    uint8_t *send;     /* slots capsule slots of slot_size bytes */
    uint32_t recv_lkey, send_lkey, recv_count, slots, slot_size, inline_max, sq_size, signal_interval;
    uint32_t in_sq, unsignaled; /* SENDs posted and not yet retired; unsignaled ones since the last signaled */
    int failed;                 /* a work completion failed, or the target broke the protocol: nothing is posted */
    int failed_status;
    char protocol_error[96];    /* why the target's response failed the queue, or empty */
    uint64_t short_responses, unknown_responses; /* responses refused (each fails the queue) */
    uint8_t *slot_busy;         /* slow path: a capsule slot waits for its SEND's completion */
    uint32_t next_slot;
    PyObject *responses;        /* slow path: CQEs received, not yet returned by poll() */
    /* preallocated for perf */
    struct ibv_send_wr *send_wrs;
    struct ibv_sge *send_sges;
    struct ibv_recv_wr *recv_wrs;
    struct ibv_sge *recv_sges;
    uint64_t *started;
    uint8_t *is_write, *busy;
    uint16_t *cids;             /* perf: each tag's CID in flight (generation << 12 | tag) */
    uint16_t *backlog;
    uint64_t *hist;
} HostQueue;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* ---- the histogram: log-linear buckets of nanoseconds ---- */

static unsigned bucket_of(uint64_t v)
{
    if (v < SUB_BUCKETS)
        return (unsigned)v;
    unsigned e = 63 - (unsigned)__builtin_clzll(v); /* >= 5 */
    unsigned idx = (e - 4) * SUB_BUCKETS + (unsigned)((v >> (e - 5)) & (SUB_BUCKETS - 1));
    return idx < HIST_BUCKETS ? idx : HIST_BUCKETS - 1;
}

static double bucket_value(unsigned idx) /* the middle of the bucket */
{
    if (idx < SUB_BUCKETS)
        return idx;
    unsigned e = idx / SUB_BUCKETS + 4, m = idx % SUB_BUCKETS;
    double width = (double)(1ULL << (e - 5));
    return (double)(SUB_BUCKETS + m) * width + width / 2;
}

/* nearest rank, as perf.py's percentile() */
static double hist_percentile(const uint64_t *hist, uint64_t n, double pct)
{
    if (!n)
        return 0.0;
    uint64_t rank = (uint64_t)(pct / 100.0 * (double)n + 0.999999999);
    if (rank < 1)
        rank = 1;
    if (rank > n)
        rank = n;
    uint64_t seen = 0;
    for (unsigned i = 0; i < HIST_BUCKETS; i++) {
        seen += hist[i];
        if (seen >= rank)
            return bucket_value(i);
    }
    return bucket_value(HIST_BUCKETS - 1);
}

/* ---- SEND accounting (as transport/rdma/host.py's SendAccount) ---- */

static int sq_room(HostQueue *q)
{
    return q->in_sq < q->sq_size;
}

/* the send flags and wr_id of one more SEND (from `slot`, or NO_SLOT: the provider copied it, inline) */
static void account_send(HostQueue *q, uint32_t slot, int inline_send, struct ibv_send_wr *wr)
{
    q->in_sq++;
    uint32_t retire = q->unsignaled + 1;
    wr->send_flags = inline_send ? IBV_SEND_INLINE : 0;
    if (slot == NO_SLOT && retire < q->signal_interval && q->in_sq < q->sq_size) {
        q->unsignaled = retire;
        wr->wr_id = SEND_WR_BASE | ((uint64_t)NO_SLOT << 32);
        return;
    }
    q->unsignaled = 0;
    wr->wr_id = SEND_WR_BASE | ((uint64_t)slot << 32) | retire;
    wr->send_flags |= IBV_SEND_SIGNALED;
}

static void send_completed(HostQueue *q, uint64_t wr_id)
{
    q->in_sq -= (uint32_t)(wr_id & 0xFFFFFFFFu);
    uint32_t slot = (uint32_t)((wr_id >> 32) & 0xFFFF);
    if (slot != NO_SLOT && slot < q->slots)
        q->slot_busy[slot] = 0;
}

static int post_recv_index(HostQueue *q, uint32_t idx)
{
    struct ibv_recv_wr *bad;
    q->recv_wrs[idx].next = NULL;
    return ibv_post_recv(q->qp, &q->recv_wrs[idx], &bad);
}

/* ---- the object ---- */

static void hostq_dealloc(HostQueue *q)
{
    Py_XDECREF(q->responses);
    PyMem_Free(q->slot_busy);
    PyMem_Free(q->send_wrs);
    PyMem_Free(q->send_sges);
    PyMem_Free(q->recv_wrs);
    PyMem_Free(q->recv_sges);
    PyMem_Free(q->started);
    PyMem_Free(q->is_write);
    PyMem_Free(q->busy);
    PyMem_Free(q->cids);
    PyMem_Free(q->backlog);
    PyMem_Free(q->hist);
    Py_TYPE(q)->tp_free((PyObject *)q);
}

/* HostQueue(qp, cq, recv_addr, recv_lkey, recv_count, send_addr, send_lkey, slots, slot_size, inline_max,
 *           sq_size, signal_interval): the QP's receives are posted here (the QP must be in INIT or later). */
static int hostq_init(HostQueue *q, PyObject *args, PyObject *kwds)
{
    unsigned long long qp, cq, recv_addr, send_addr, channel = 0;
    unsigned int recv_lkey, recv_count, send_lkey, slots, slot_size, inline_max, sq_size, interval;
    if (!PyArg_ParseTuple(args, "KKKIIKIIIIII|K", &qp, &cq, &recv_addr, &recv_lkey, &recv_count,
                          &send_addr, &send_lkey, &slots, &slot_size, &inline_max, &sq_size, &interval, &channel))
        return -1;
    if (q->qp) {
        PyErr_SetString(PyExc_RuntimeError, "HostQueue is already initialised");
        return -1;
    }
    if (!qp || !cq || !recv_addr || !send_addr) {
        PyErr_SetString(PyExc_ValueError, "HostQueue: the QP, the CQ and both buffers are needed (an address is 0)");
        return -1;
    }
    if (!slots || slots > MAX_DEPTH || slots >= NO_SLOT || recv_count < 1 || recv_count > 4 * MAX_DEPTH ||
        slot_size < SQE_SIZE || !sq_size || !interval || interval > sq_size) {
        PyErr_Format(PyExc_ValueError,
                     "HostQueue: slots %u (1 to %u), receives %u, slot size %u (>= 64), send queue %u, "
                     "signal interval %u (1 to the send queue)", slots, MAX_DEPTH, recv_count, slot_size, sq_size,
                     interval);
        return -1;
    }
    q->slot_busy = PyMem_Calloc(slots, 1);
    q->send_wrs = PyMem_Calloc(slots, sizeof *q->send_wrs);
    q->send_sges = PyMem_Calloc(slots, sizeof *q->send_sges);
    q->recv_wrs = PyMem_Calloc(recv_count, sizeof *q->recv_wrs);
    q->recv_sges = PyMem_Calloc(recv_count, sizeof *q->recv_sges);
    q->started = PyMem_Calloc(slots, sizeof *q->started);
    q->is_write = PyMem_Calloc(slots, 1);
    q->busy = PyMem_Calloc(slots, 1);
    q->cids = PyMem_Calloc(slots, sizeof *q->cids);
    q->backlog = PyMem_Calloc(slots, sizeof *q->backlog);
    q->hist = PyMem_Calloc(HIST_BUCKETS, sizeof *q->hist);
    q->responses = PyList_New(0);
    if (!q->slot_busy || !q->send_wrs || !q->send_sges || !q->recv_wrs || !q->recv_sges || !q->started ||
        !q->is_write || !q->busy || !q->cids || !q->backlog || !q->hist || !q->responses) {
        PyErr_NoMemory();
        return -1;
    }
    q->qp = (struct ibv_qp *)(uintptr_t)qp;
    q->cq = (struct ibv_cq *)(uintptr_t)cq;
    q->channel = (struct ibv_comp_channel *)(uintptr_t)channel;
    q->recv = (uint8_t *)(uintptr_t)recv_addr;
    q->send = (uint8_t *)(uintptr_t)send_addr;
    q->recv_lkey = recv_lkey;
    q->recv_count = recv_count;
    q->send_lkey = send_lkey;
    q->slots = slots;
    q->slot_size = slot_size;
    q->inline_max = inline_max;
    q->sq_size = sq_size;
    q->signal_interval = interval;
    for (uint32_t i = 0; i < slots; i++) {
        struct ibv_send_wr *wr = &q->send_wrs[i];
        q->send_sges[i].addr = send_addr + (uint64_t)i * slot_size;
        q->send_sges[i].lkey = send_lkey;
        wr->sg_list = &q->send_sges[i];
        wr->num_sge = 1;
        wr->opcode = IBV_WR_SEND;
    }
    for (uint32_t i = 0; i < recv_count; i++) {
        q->recv_sges[i].addr = recv_addr + (uint64_t)i * CQE_SIZE;
        q->recv_sges[i].length = CQE_SIZE;
        q->recv_sges[i].lkey = recv_lkey;
        q->recv_wrs[i].wr_id = i;
        q->recv_wrs[i].sg_list = &q->recv_sges[i];
        q->recv_wrs[i].num_sge = 1;
        int rc = post_recv_index(q, i);
        if (rc) {
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
    }
    return 0;
}

static PyObject *connection_lost(HostQueue *q)
{
    if (q->protocol_error[0])
        return PyErr_Format(PyExc_ConnectionError, "queue failed: %s: the target violated the protocol",
                            q->protocol_error);
    return PyErr_Format(PyExc_ConnectionError, "work completion failed with status %d (%s): connection lost",
                        q->failed_status, ibv_wc_status_str((enum ibv_wc_status)q->failed_status));
}

/* A received response that is not a whole CQE fails the queue (nvme-rdma: "Unexpected nvme completion length"). */
static int response_too_short(HostQueue *q, const struct ibv_wc *wc)
{
    if (wc->byte_len >= CQE_SIZE)
        return 0;
    q->short_responses++;
    if (!q->failed) {
        q->failed = 1;
        snprintf(q->protocol_error, sizeof q->protocol_error, "a response of %u bytes (a CQE is %d)", wc->byte_len,
                 CQE_SIZE);
    }
    return 1;
}

/* A response naming no command in flight fails the queue (nvme-rdma: "got bad command_id", error recovery). */
static void response_not_in_flight(HostQueue *q, uint16_t cid)
{
    q->unknown_responses++;
    if (!q->failed) {
        q->failed = 1;
        snprintf(q->protocol_error, sizeof q->protocol_error,
                 "a response for command ID %#x, which is not in flight", cid);
    }
}

/* Take completions (GIL held: the slow path).  Returns the number taken, or -1 with an exception set. */
static int slow_drain(HostQueue *q)
{
    struct ibv_wc wc[POLL_BATCH];
    int total = 0;
    for (;;) {
        int n = ibv_poll_cq(q->cq, POLL_BATCH, wc);
        if (n < 0) {
            PyErr_SetString(PyExc_OSError, "ibv_poll_cq failed");
            return -1;
        }
        for (int i = 0; i < n; i++) {
            if (wc[i].status != IBV_WC_SUCCESS) {
                q->failed = 1;
                q->failed_status = wc[i].status;
                continue;
            }
            if (wc[i].wr_id & SEND_WR_BASE) {
                send_completed(q, wc[i].wr_id);
                continue;
            }
            if (response_too_short(q, &wc[i]))
                continue; /* the CID of a short response is not read (the Python initiator checks it otherwise) */
            uint32_t idx = (uint32_t)wc[i].wr_id;
            PyObject *cqe = PyBytes_FromStringAndSize((const char *)q->recv + (size_t)idx * CQE_SIZE, CQE_SIZE);
            if (!cqe || PyList_Append(q->responses, cqe) < 0) {
                Py_XDECREF(cqe);
                return -1;
            }
            Py_DECREF(cqe);
            post_recv_index(q, idx);
        }
        total += n;
        if (n < POLL_BATCH)
            return total;
    }
}

/* send(capsule): one capsule from a slot of its own, signaled (the slot is free again when it completes) */
static PyObject *hostq_send(HostQueue *q, PyObject *arg)
{
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    if (q->failed) {
        connection_lost(q);
        goto out;
    }
    if ((size_t)view.len > q->slot_size || view.len < SQE_SIZE) {
        PyErr_Format(PyExc_ValueError, "capsule of %zd bytes: 64 to %u fit a slot", view.len, q->slot_size);
        goto out;
    }
    uint64_t deadline = now_ns() + 5000000000ULL;
    uint32_t slot = q->next_slot % q->slots;
    while (q->slot_busy[slot] || !sq_room(q)) {
        if (slow_drain(q) < 0)
            goto out;
        if (q->failed) {
            connection_lost(q);
            goto out;
        }
        if (now_ns() > deadline) {
            PyErr_SetString(PyExc_TimeoutError, "send queue full: no SEND completed in 5 s");
            goto out;
        }
    }
    q->next_slot = slot + 1;
    memcpy(q->send + (size_t)slot * q->slot_size, view.buf, view.len);
    struct ibv_send_wr *wr = &q->send_wrs[slot], *bad;
    wr->next = NULL;
    q->send_sges[slot].length = (uint32_t)view.len;
    q->slot_busy[slot] = 1;
    account_send(q, slot, 0, wr);
    int rc = ibv_post_send(q->qp, wr, &bad);
    if (rc) {
        q->slot_busy[slot] = 0;
        q->in_sq--;
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        goto out;
    }
    Py_INCREF(Py_None);
    result = Py_None;
out:
    PyBuffer_Release(&view);
    return result;
}

/* poll(timeout) -> [cqe bytes]: waits (busy, the GIL let go between tries) up to timeout s for at least one */
static PyObject *hostq_poll(HostQueue *q, PyObject *args)
{
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout))
        return NULL;
    uint64_t deadline = now_ns() + (uint64_t)(timeout > 0 ? timeout * 1e9 : 0);
    for (;;) {
        if (slow_drain(q) < 0)
            return NULL;
        if (PyList_GET_SIZE(q->responses) || q->failed || now_ns() >= deadline)
            break;
        Py_BEGIN_ALLOW_THREADS
        struct timespec pause = {0, 20000};
        nanosleep(&pause, NULL);
        Py_END_ALLOW_THREADS
    }
    if (q->protocol_error[0] || (!PyList_GET_SIZE(q->responses) && q->failed))
        return connection_lost(q); /* a protocol error at once: what came with it is not trusted */
    PyObject *out = q->responses;
    q->responses = PyList_New(0);
    if (!q->responses) {
        q->responses = out;
        return NULL;
    }
    return out;
}

/* ---- perf: the measured loop ---- */

struct perf_params {
    uint32_t nsid, nlb, block_size, depth, read_percent;
    int busy_poll;
    uint64_t span_slots, max_ios, data_addr, ramp_ns, runtime_ns, seed;
    uint32_t data_rkey;
};

struct perf_counts {
    uint64_t ios, reads, writes, errors, unexpected, lat_sum, lat_max, elapsed_ns;
    uint64_t doorbells, sends, signaled, recv_doorbells, polls, backlogged, sleeps, arms;
    int first_error, lost, drain_timeout, post_error;
    uint32_t in_flight_left;
};

static uint64_t next_random(uint64_t *state) /* xorshift64* */
{
    uint64_t x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* Fill tag's SQE in its slot and chain its SEND after *tail. */
static void build_io(HostQueue *q, const struct perf_params *p, uint64_t *rng, uint32_t tag,
                     struct ibv_send_wr **head, struct ibv_send_wr **tail, struct perf_counts *c)
{
    uint64_t r = next_random(rng);
    int write = (uint32_t)(r % 100) >= p->read_percent;
    uint64_t slba = ((r >> 8) % p->span_slots) * p->nlb;
    uint8_t *sqe = q->send + (size_t)tag * q->slot_size;
    uint64_t data = p->data_addr + (uint64_t)tag * p->block_size;
    memset(sqe, 0, SQE_SIZE);
    sqe[0] = write ? 0x01 : 0x02; /* Write / Read */
    sqe[1] = 0x40;                /* PSDT 01b: SGL, metadata as a pointer */
    uint16_t cid = q->cids[tag] = (uint16_t)((((q->cids[tag] >> CID_TAG_BITS) + 1) << CID_TAG_BITS) | tag);
    sqe[2] = (uint8_t)cid;
    sqe[3] = (uint8_t)(cid >> 8);
    memcpy(sqe + 4, &p->nsid, 4);
    memcpy(sqe + 24, &data, 8);                  /* keyed SGL data block: address */
    uint32_t len = p->block_size;
    sqe[32] = (uint8_t)len;                      /* length, 3 bytes */
    sqe[33] = (uint8_t)(len >> 8);
    sqe[34] = (uint8_t)(len >> 16);
    memcpy(sqe + 35, &p->data_rkey, 4);          /* key */
    sqe[39] = 0x40;                              /* keyed data block, address subtype */
    memcpy(sqe + 40, &slba, 8);                  /* CDW10-11 */
    uint32_t cdw12 = p->nlb - 1;
    memcpy(sqe + 48, &cdw12, 4);
    q->is_write[tag] = (uint8_t)write;
    q->busy[tag] = 1;
    struct ibv_send_wr *wr = &q->send_wrs[tag];
    q->send_sges[tag].length = SQE_SIZE;
    /* The slot is reused only after the command's response, when the target has the capsule: no slot to hold */
    account_send(q, NO_SLOT, q->inline_max >= SQE_SIZE, wr);
    c->signaled += (wr->send_flags & IBV_SEND_SIGNALED) != 0;
    wr->next = NULL;
    if (*tail)
        (*tail)->next = wr;
    else
        *head = wr;
    *tail = wr;
    c->sends++;
}

/* Sleep on the armed CQ's channel until its event (taken and acked) or SLEEP_MS. */
static void sleep_on_channel(HostQueue *q)
{
    struct pollfd pfd = {.fd = q->channel->fd, .events = POLLIN};
    if (poll(&pfd, 1, SLEEP_MS) > 0) {
        struct ibv_cq *cq;
        void *context;
        if (!ibv_get_cq_event(q->channel, &cq, &context))
            ibv_ack_cq_events(cq, 1);
    }
}

static void run_perf(HostQueue *q, const struct perf_params *p, struct perf_counts *c)
{
    struct ibv_wc wc[POLL_BATCH];
    uint64_t rng = p->seed ? p->seed : 0x9E3779B97F4A7C15ULL;
    uint32_t in_flight = 0, nbacklog = 0, empty_polls = 0;
    int armed = 0; /* armed since the last poll that found a completion: the next empty poll may sleep */
    uint64_t start = now_ns(), measure_from = start + p->ramp_ns, end = measure_from + p->runtime_ns;
    int measuring = p->ramp_ns == 0, running = 1;
    uint64_t drain_deadline = 0;
    memset(q->hist, 0, HIST_BUCKETS * sizeof *q->hist);
    memset(q->busy, 0, q->slots);

    struct ibv_send_wr *head = NULL, *tail = NULL, *bad;
    for (uint32_t tag = 0; tag < p->depth; tag++) {
        if (sq_room(q))
            build_io(q, p, &rng, tag, &head, &tail, c);
        else
            q->backlog[nbacklog++] = (uint16_t)tag;
    }
    uint64_t now = now_ns();
    for (struct ibv_send_wr *wr = head; wr; wr = wr->next)
        q->started[wr - q->send_wrs] = now;
    if (head) {
        c->doorbells++;
        if (ibv_post_send(q->qp, head, &bad)) {
            c->post_error = 1;
            return;
        }
    }
    in_flight = p->depth - nbacklog;

    while (in_flight || nbacklog) {
        int n = ibv_poll_cq(q->cq, POLL_BATCH, wc);
        c->polls++;
        if (n == 0 && q->channel && !p->busy_poll && ++empty_polls >= EMPTY_POLLS_BEFORE_SLEEP) {
            if (!armed) {
                /* Arm, then poll once more before sleeping: a completion that landed between the last poll and
                 * the arm raises no event (the verbs contract) and would wait out the whole sleep. */
                armed = !ibv_req_notify_cq(q->cq, 0);
                c->arms += armed;
                empty_polls--; /* the next empty poll comes back here, and sleeps */
                continue;
            }
            sleep_on_channel(q); /* leave the CPU to the kernel (rxe, a target on this machine) */
            armed = 0;
            empty_polls = 0;
            c->sleeps++;
            continue;
        }
        if (n) {
            empty_polls = 0;
            armed = 0; /* the next sleep arms again first: harmless on an armed CQ, and it keeps the rule simple */
        }
        now = now_ns();
        if (n < 0) {
            c->post_error = 1;
            break;
        }
        if (!measuring && now >= measure_from) {
            measuring = 1;
            measure_from = now;
            end = now + p->runtime_ns;
        }
        if (running && measuring && now >= end) {
            running = 0;
            c->elapsed_ns = now - measure_from;
            drain_deadline = now + DRAIN_NS;
            nbacklog = 0; /* never issued: nothing to wait for */
        }
        if (!running && now > drain_deadline) {
            c->drain_timeout = 1;
            break;
        }
        head = tail = NULL;
        struct ibv_recv_wr *rhead = NULL, *rtail = NULL;
        for (int i = 0; i < n; i++) {
            if (wc[i].status != IBV_WC_SUCCESS) {
                q->failed = 1;
                q->failed_status = wc[i].status;
                c->lost = 1;
                continue;
            }
            uint64_t wr_id = wc[i].wr_id;
            if (wr_id & SEND_WR_BASE) {
                send_completed(q, wr_id);
                continue;
            }
            if (response_too_short(q, &wc[i])) {
                c->unexpected++;
                continue;
            }
            uint32_t idx = (uint32_t)wr_id;
            const uint8_t *cqe = q->recv + (size_t)idx * CQE_SIZE;
            uint16_t cid = (uint16_t)(cqe[12] | cqe[13] << 8), tag = cid & CID_TAG_MASK;
            uint16_t status = (uint16_t)((cqe[14] | cqe[15] << 8) >> 1);
            struct ibv_recv_wr *rwr = &q->recv_wrs[idx];
            rwr->next = NULL;
            if (rtail)
                rtail->next = rwr;
            else
                rhead = rwr;
            rtail = rwr;
            if (tag >= p->depth || !q->busy[tag] || q->cids[tag] != cid) {
                response_not_in_flight(q, cid);
                c->unexpected++;
                continue;
            }
            q->busy[tag] = 0;
            in_flight--;
            if (measuring && running) {
                uint64_t lat = now - q->started[tag];
                q->hist[bucket_of(lat)]++;
                c->lat_sum += lat;
                if (lat > c->lat_max)
                    c->lat_max = lat;
                c->ios++;
                if (q->is_write[tag])
                    c->writes++;
                else
                    c->reads++;
                if (status) {
                    c->errors++;
                    if (!c->first_error)
                        c->first_error = status;
                }
                if (p->max_ios && c->ios >= p->max_ios) { /* exactly max_ios measured: the rest drain */
                    running = 0;
                    c->elapsed_ns = now - measure_from;
                    drain_deadline = now + DRAIN_NS;
                    nbacklog = 0;
                }
            }
            if (running && !q->failed)
                q->backlog[nbacklog++] = tag;
        }
        if (q->failed)
            break;
        if (rhead) { /* receives first: the responses to what follows need them */
            struct ibv_recv_wr *rbad;
            c->recv_doorbells++;
            if (ibv_post_recv(q->qp, rhead, &rbad)) {
                c->post_error = 1;
                break;
            }
        }
        uint32_t issued = 0;
        while (issued < nbacklog && sq_room(q))
            build_io(q, p, &rng, q->backlog[issued++], &head, &tail, c);
        if (issued) {
            memmove(q->backlog, q->backlog + issued, (nbacklog - issued) * sizeof *q->backlog);
            nbacklog -= issued;
            c->backlogged += nbacklog;
            for (struct ibv_send_wr *wr = head; wr; wr = wr->next)
                q->started[wr - q->send_wrs] = now;
            c->doorbells++;
            in_flight += issued;
            if (ibv_post_send(q->qp, head, &bad)) {
                c->post_error = 1;
                break;
            }
        }
    }
    if (running)
        c->elapsed_ns = now - measure_from;
    c->in_flight_left = in_flight;
}

static PyObject *hostq_perf(HostQueue *q, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"nsid", "nlb", "block_size", "span_slots", "queue_depth", "read_percent", "data_addr",
                             "data_rkey", "runtime", "ramp", "max_ios", "seed", "busy_poll", NULL};
    struct perf_params p = {0};
    double runtime = 1.0, ramp = 0.0;
    unsigned long long span_slots, data_addr, max_ios = 0, seed = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "IIIKIIKI|ddKKp", kwlist, &p.nsid, &p.nlb, &p.block_size,
                                     &span_slots, &p.depth, &p.read_percent, &data_addr, &p.data_rkey, &runtime,
                                     &ramp, &max_ios, &seed, &p.busy_poll))
        return NULL;
    if (!p.nlb || p.nlb > 65536 || !p.block_size || p.block_size >= (1u << 24) || !span_slots || !p.depth ||
        p.depth > q->slots || p.depth > q->recv_count || p.read_percent > 100 || !data_addr || runtime < 0 ||
        ramp < 0) {
        return PyErr_Format(PyExc_ValueError,
                            "perf: nlb %u (1 to 65536), block size %u (below 16 MiB), span %llu slots (>= 1), queue "
                            "depth %u (1 to the queue's %u slots and %u receives), read percent %u (0 to 100)",
                            p.nlb, p.block_size, span_slots, p.depth, q->slots, q->recv_count, p.read_percent);
    }
    if (q->failed)
        return connection_lost(q);
    for (uint32_t i = 0; i < q->slots; i++)
        if (q->slot_busy[i])
            if (slow_drain(q) < 0)
                return NULL;
    p.span_slots = span_slots;
    p.data_addr = data_addr;
    p.max_ios = max_ios;
    p.seed = seed;
    p.runtime_ns = (uint64_t)(runtime * 1e9);
    p.ramp_ns = (uint64_t)(ramp * 1e9);
    struct perf_counts c;
    memset(&c, 0, sizeof c);
    Py_BEGIN_ALLOW_THREADS
    run_perf(q, &p, &c);
    Py_END_ALLOW_THREADS
    if (c.lost || q->protocol_error[0])
        return connection_lost(q);
    if (c.post_error)
        return PyErr_Format(PyExc_OSError, "perf: posting a work request or polling the CQ failed (%d in flight)",
                            c.in_flight_left);
    if (c.drain_timeout)
        return PyErr_Format(PyExc_TimeoutError, "perf: %u commands still in flight 10 s after the run ended",
                            c.in_flight_left);
    uint64_t n = c.ios;
    PyObject *hist = PyBytes_FromStringAndSize((const char *)q->hist, HIST_BUCKETS * sizeof *q->hist);
    if (!hist)
        return NULL;
    return Py_BuildValue(
        "{sKsKsKsKsKsKsisKsKsKsKsKsKsKsKsdsdsdsdsdsdsNsI}", "ios", (unsigned long long)n, "reads",
        (unsigned long long)c.reads, "writes", (unsigned long long)c.writes, "errors", (unsigned long long)c.errors,
        "unexpected", (unsigned long long)c.unexpected, "elapsed_ns", (unsigned long long)c.elapsed_ns,
        "first_error", c.first_error, "doorbells", (unsigned long long)c.doorbells, "sends",
        (unsigned long long)c.sends, "signaled", (unsigned long long)c.signaled, "recv_doorbells",
        (unsigned long long)c.recv_doorbells, "polls", (unsigned long long)c.polls, "backlogged",
        (unsigned long long)c.backlogged, "sleeps", (unsigned long long)c.sleeps, "arms",
        (unsigned long long)c.arms, "p50",
        hist_percentile(q->hist, n, 50.0) / 1e3, "p90",
        hist_percentile(q->hist, n, 90.0) / 1e3, "p99", hist_percentile(q->hist, n, 99.0) / 1e3, "p99.9",
        hist_percentile(q->hist, n, 99.9) / 1e3, "mean", n ? (double)c.lat_sum / (double)n / 1e3 : 0.0, "max",
        (double)c.lat_max / 1e3, "hist", hist, "sub_buckets", (unsigned)SUB_BUCKETS);
}

static PyObject *hostq_stats(HostQueue *q, PyObject *unused)
{
    return Py_BuildValue("{sIsIsisKsK}", "in_sq", q->in_sq, "sq_size", q->sq_size, "failed", q->failed,
                         "short_responses", (unsigned long long)q->short_responses, "unknown_responses",
                         (unsigned long long)q->unknown_responses);
}

static PyMethodDef hostq_methods[] = {
    {"send", (PyCFunction)hostq_send, METH_O, "send(capsule): SEND one capsule from a slot of its own."},
    {"poll", (PyCFunction)hostq_poll, METH_VARARGS, "poll(timeout) -> [16-byte CQEs], waiting up to timeout s."},
    {"perf", (PyCFunction)(void (*)(void))hostq_perf, METH_VARARGS | METH_KEYWORDS,
     "perf(nsid, nlb, block_size, span_slots, queue_depth, read_percent, data_addr, data_rkey, runtime=1.0, "
     "ramp=0.0, max_ios=0, seed=0, busy_poll=False) -> counts and latency percentiles (µs); the GIL is released "
     "while it runs."},
    {"stats", (PyCFunction)hostq_stats, METH_NOARGS,
     "stats() -> {in_sq, sq_size, failed, short_responses, unknown_responses}."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject HostQueueType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmeof_roce._native.HostQueue",
    .tp_doc = "An initiator I/O queue's data path on a QP and CQ made elsewhere (csrc/hostq.c).",
    .tp_basicsize = sizeof(HostQueue),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)hostq_init,
    .tp_dealloc = (destructor)hostq_dealloc,
    .tp_methods = hostq_methods,
};

/* ---- the verbs objects, on the CM id (not on the per-command path) ---- */

/* create_host_qp(cm, cm_id, cq_size, max_send_wr, max_recv_wr, max_inline) -> {qp, cq, pd, qp_num, max_inline}:
 * on the id the handle cm_id names on the CmChannel cm (native_cm_id: a stale handle is a ValueError); one CQ
 * for sends and receives, polled (no channel); librdmacm takes the QP to INIT, and to RTR and RTS when the
 * connect response arrives. */
static PyObject *create_host_qp(PyObject *self, PyObject *args)
{
    PyObject *cm, *handle;
    unsigned int cq_size, send_wr, recv_wr, inline_size;
    if (!PyArg_ParseTuple(args, "OOIIII", &cm, &handle, &cq_size, &send_wr, &recv_wr, &inline_size))
        return NULL;
    struct rdma_cm_id *id = native_cm_id(cm, handle);
    if (!id)
        return NULL;
    if (id->qp) {
        PyErr_SetString(PyExc_RuntimeError, "this CM id already has a QP");
        return NULL;
    }
    if (!id->verbs) {
        PyErr_SetString(PyExc_RuntimeError, "the CM id has no device yet (resolve its address first)");
        return NULL;
    }
    struct ibv_comp_channel *channel = ibv_create_comp_channel(id->verbs);
    if (!channel)
        return PyErr_SetFromErrno(PyExc_OSError);
    int flags = fcntl(channel->fd, F_GETFL);
    struct ibv_cq *cq = flags < 0 || fcntl(channel->fd, F_SETFL, flags | O_NONBLOCK) ? NULL
                        : ibv_create_cq(id->verbs, (int)cq_size, NULL, channel, 0);
    if (!cq) {
        int err = errno;
        ibv_destroy_comp_channel(channel);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    struct ibv_qp_init_attr attr;
    for (int attempt = 0; attempt < 2; attempt++) { /* without inline data if the device has none */
        memset(&attr, 0, sizeof attr);
        attr.qp_type = IBV_QPT_RC;
        attr.send_cq = attr.recv_cq = cq;
        attr.cap.max_send_wr = send_wr;
        attr.cap.max_recv_wr = recv_wr;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        attr.cap.max_inline_data = attempt ? 0 : inline_size;
        if (!native_cm_create_qp(id, NULL, &attr))
            break;
        if (attempt || !inline_size) {
            int err = errno;
            ibv_destroy_cq(cq);
            ibv_destroy_comp_channel(channel);
            errno = err;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    return Py_BuildValue("{sKsKsKsKsIsI}", "qp", (unsigned long long)(uintptr_t)id->qp, "cq",
                         (unsigned long long)(uintptr_t)cq, "channel", (unsigned long long)(uintptr_t)channel, "pd",
                         (unsigned long long)(uintptr_t)id->pd, "qp_num",
                         id->qp->qp_num, "max_inline", attr.cap.max_inline_data);
}

/* destroy_host_qp(cm, cm_id, cq, channel): the QP (librdmacm's), then our CQ and its channel */
static PyObject *destroy_host_qp(PyObject *self, PyObject *args)
{
    PyObject *cm, *handle;
    unsigned long long cq, channel = 0;
    if (!PyArg_ParseTuple(args, "OOK|K", &cm, &handle, &cq, &channel))
        return NULL;
    struct rdma_cm_id *id = native_cm_id(cm, handle);
    if (!id)
        return NULL;
    if (id->qp)
        native_cm_destroy_qp(id);
    if (cq) {
        int rc = ibv_destroy_cq((struct ibv_cq *)(uintptr_t)cq);
        if (rc) {
            errno = rc;
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    }
    if (channel && ibv_destroy_comp_channel((struct ibv_comp_channel *)(uintptr_t)channel))
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyMethodDef hostq_functions[] = {
    {"create_host_qp", create_host_qp, METH_VARARGS,
     "create_host_qp(cm, cm_id, cq_size, max_send_wr, max_recv_wr, max_inline) -> {qp, cq, channel, pd, qp_num, "
     "max_inline} on the id the handle cm_id names on the CmChannel cm"},
    {"destroy_host_qp", destroy_host_qp, METH_VARARGS,
     "destroy_host_qp(cm, cm_id, cq, channel): the QP, then the CQ and its channel."},
    {NULL, NULL, 0, NULL},
};

int native_hostq_register(PyObject *module)
{
    if (PyType_Ready(&HostQueueType) < 0)
        return -1;
    Py_INCREF(&HostQueueType);
    if (PyModule_AddObject(module, "HostQueue", (PyObject *)&HostQueueType) < 0) {
        Py_DECREF(&HostQueueType);
        return -1;
    }
    return PyModule_AddFunctions(module, hostq_functions);
}
