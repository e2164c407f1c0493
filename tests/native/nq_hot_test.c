/* The native queue's hot path (csrc/nq_hot.c) driven with no Python at all: a plain C program linked with the fake
 * verbs provider (tests/native/fakeprov.c), csrc/nq_hot.c, mailbox.c, and uring.c and trace.c built with
 * -DNATIVE_PLAIN_C.  tests/unit/test_native_hot_c.py builds it (with -DNQ_CHECKED: every request state change is
 * checked against nq_next) and runs it; it prints "ok" and exits 0, or names the first check that failed.
 *
 * It checks what the hot path owns alone: Reads and Writes of a RAM namespace served and their bytes moved, one
 * RDMA READ credit never used twice (the owner's READs included), a Read never waiting behind a Write waiting for
 * a credit, a capsule the view does not serve handed to the owner, and a close that sends what was batched first.
 */
#include "nq_hot.h"

extern const struct nq_backend_ops nq_backend_ram; /* csrc/be_ram.c */

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* tests/native/fakeprov.c */
void *fakehost_new(int shared_cq);
void fakehost_free(void *dev);
void *fakehost_qp(void *dev);
void *fakehost_send_cq(void *dev);
void *fakehost_recv_cq(void *dev);
uint32_t fakehost_reg_local(void *dev, uint64_t addr, uint64_t len);
uint32_t fakehost_reg_remote(void *dev, uint64_t addr, uint64_t len);
int fakehost_deliver(void *dev, const void *capsule, uint32_t len);
uint32_t fakehost_responses(void *dev, void *out, uint32_t max);
void fakehost_counters(void *dev, uint64_t *out);
void fakehost_hold(void *dev, int hold);
uint32_t fakehost_release(void *dev, uint32_t n);

#define DEPTH 32
#define ICD 4096
#define RECV_SIZE (64 + ICD)
#define NS_BYTES (1 << 20)
#define HOST_BYTES (1 << 20)
#define COUNTER_READS 6    /* fakehost_counters: RDMA READs executed so far */
#define COUNTER_ON_WIRE 11 /* fakehost_counters: work requests on the wire now */

static int failures;

#define CHECK(cond, ...)                                                                                            \
    do {                                                                                                            \
        if (!(cond)) {                                                                                              \
            fprintf(stderr, "%s:%d: %s: ", __FILE__, __LINE__, #cond);                                              \
            fprintf(stderr, __VA_ARGS__);                                                                           \
            fprintf(stderr, "\n");                                                                                  \
            failures++;                                                                                             \
        }                                                                                                           \
    } while (0)

/* what the hot path handed to its owner */
static struct {
    int capsules, send_done, failures;
    uint8_t last_capsule[64];
    int disconnect; /* answer a capsule handed over and close the queue, inside the poll, as a Disconnect */
    int close_busy;
} owner;

static void hook_capsule(struct nq_queue *q, const char *capsule, uint32_t len, int handed_back)
{
    owner.capsules++;
    memcpy(owner.last_capsule, capsule, len < 64 ? len : 64);
    if (owner.disconnect) {
        uint8_t cqe[16] = {0};
        cqe[12] = (uint8_t)capsule[2];
        cqe[13] = (uint8_t)capsule[3];
        CHECK(nq_post_owner_response(q, 1, cqe, 0, 0, 0, 0, 0, 0, -1) == 0, "the Disconnect's answer batched");
        owner.close_busy = nq_begin_close(q);
    }
}

static void hook_send_done(struct nq_queue *q, uint64_t tag) { owner.send_done++; }
static void hook_failure(struct nq_queue *q, int status, uint64_t wr_id) { owner.failures++; }

static const struct nq_hooks hooks = {hook_capsule, hook_send_done, hook_failure};

struct env {
    void *dev;
    struct nq_queue q;
    struct nq_view view;
    struct nq_ns ns;
    char *recv, *ram, *host;
    uint32_t host_key;
};

static void env_open(struct env *e, uint32_t reads)
{
    memset(e, 0, sizeof *e);
    memset(&owner, 0, sizeof owner);
    e->dev = fakehost_new(1);
    e->recv = calloc(DEPTH + 1, RECV_SIZE);
    e->ram = calloc(1, NS_BYTES);
    e->host = calloc(1, HOST_BYTES);
    struct nq_params p = {
        .qp = fakehost_qp(e->dev), .send_cq = fakehost_send_cq(e->dev), .recv_cq = fakehost_recv_cq(e->dev),
        .qid = 1, .recv_base = e->recv,
        .recv_lkey = fakehost_reg_local(e->dev, (uintptr_t)e->recv, (uint64_t)(DEPTH + 1) * RECV_SIZE),
        .recv_count = DEPTH + 1, .recv_size = RECV_SIZE, .requests = DEPTH + 1, .send_queue = 4 * DEPTH + 8,
        .python_send = DEPTH + 2, .reads = reads, .remote_invalidate = 1, .hooks = &hooks, .tell_send_done = 1};
    int rc = nq_queue_init(&e->q, &p);
    CHECK(rc == 0, "nq_queue_init: %d", rc);
    e->ns = (struct nq_ns){.nsid = 1, .ops = &nq_backend_ram, .be_flags = (uint8_t)nq_backend_ram.flags, .lbads = 9,
                           .num_blocks = NS_BYTES >> 9, .base = e->ram,
                           .lkey = fakehost_reg_local(e->dev, (uintptr_t)e->ram, NS_BYTES), .gen = 1,
                           .ref = calloc(1, sizeof(struct nq_ref))};
    CHECK(e->ns.ref, "calloc");
    e->ns.ref->word = NQ_REF_HOLDER; /* the test's, as the view's would be */
    e->view = (struct nq_view){.ready = 1, .max_transfer = 128 * 1024, .count = 1, .ns = &e->ns};
    e->q.view = &e->view;
    e->host_key = fakehost_reg_remote(e->dev, (uintptr_t)e->host, HOST_BYTES);
}

static void env_close(struct env *e)
{
    e->q.view = NULL;
    nq_queue_free(&e->q);
    CHECK(nq_ref_commands(e->ns.ref) == 0, "every command let go of its namespace reference: %u still hold it",
          nq_ref_commands(e->ns.ref));
    nq_ref_unhold(e->ns.ref);
    fakehost_free(e->dev);
    free(e->recv);
    free(e->ram);
    free(e->host);
}

static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* a Read or Write of 4 KiB (8 blocks) at `slba`, its data at `offset` of the host's buffer (keyed SGL) */
static void deliver_io(struct env *e, uint8_t opc, uint32_t nsid, uint64_t slba, uint32_t offset, uint16_t cid)
{
    uint8_t sqe[64] = {0};
    sqe[0] = opc;
    sqe[1] = 0x40; /* SGL */
    sqe[2] = cid & 0xFF;
    sqe[3] = cid >> 8;
    put32(sqe + 4, nsid);
    put64(sqe + 24, (uintptr_t)e->host + offset);
    uint64_t dptr2 = 4096 | ((uint64_t)e->host_key << 24) | ((uint64_t)0x40 << 56);
    put64(sqe + 32, dptr2);
    put64(sqe + 40, slba);
    put32(sqe + 48, 7);
    int rc = fakehost_deliver(e->dev, sqe, sizeof sqe);
    CHECK(rc == 0, "deliver cid %u: %d", cid, rc);
}

/* the responses since the last call: their cids into `cids`, their statuses checked 0; how many */
static int responses(struct env *e, uint16_t *cids, int max)
{
    uint8_t out[24 * 256];
    uint32_t n = fakehost_responses(e->dev, out, 256);
    for (uint32_t i = 0; i < n && (int)i < max; i++) {
        const uint8_t *cqe = out + 24 * i;
        cids[i] = (uint16_t)(cqe[12] | cqe[13] << 8);
        uint16_t status = (uint16_t)((cqe[14] | cqe[15] << 8) >> 1);
        CHECK(status == 0, "cid %u answered status 0x%x", cids[i], status);
    }
    return (int)n;
}

static uint64_t counter(struct env *e, int which)
{
    uint64_t c[14];
    fakehost_counters(e->dev, c);
    return c[which];
}

static uint64_t on_wire(struct env *e) { return counter(e, COUNTER_ON_WIRE); }

static void pump(struct env *e)
{
    for (int i = 0; i < 64 && nq_poll(&e->q, 256); i++)
        ;
}

static void fill(char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (char)(seed * 31 + i * 7 + (i >> 9));
}

static void test_reads_and_writes_move_their_bytes(void)
{
    struct env e;
    env_open(&e, 16);
    fill(e.host, 8 * 4096, 3);
    for (int i = 0; i < 8; i++)
        deliver_io(&e, 0x01, 1, 8 * i, 4096 * i, (uint16_t)i);
    pump(&e);
    uint16_t cids[64];
    CHECK(responses(&e, cids, 64) == 8, "8 Writes answered");
    CHECK(!memcmp(e.ram, e.host, 8 * 4096), "the Writes' data in the namespace");
    fill(e.ram + 64 * 4096, 4096, 5);
    deliver_io(&e, 0x02, 1, 64 * 8, 65536, 9);
    pump(&e);
    CHECK(responses(&e, cids, 64) == 1 && cids[0] == 9, "the Read answered");
    CHECK(!memcmp(e.host + 65536, e.ram + 64 * 4096, 4096), "the Read's data at the host");
    CHECK(owner.capsules == 0 && e.q.native_commands == 9, "served without the owner");
    env_close(&e);
}

static void test_one_read_credit_is_never_used_twice(void)
{
    struct env e;
    env_open(&e, 1);
    for (int i = 0; i < 4; i++)
        deliver_io(&e, 0x01, 1, 8 * i, 4096 * i, (uint16_t)i);
    fakehost_hold(e.dev, 1);
    nq_poll(&e.q, 256);
    /* the owner's READ (a Write the core serves) waits for the same credit */
    struct nq_py_read r = {.tag = 7, .lkey = e.ns.lkey, .length = 4096, .rkey = e.host_key,
                           .laddr = (uintptr_t)e.ram + 128 * 4096, .raddr = (uintptr_t)e.host + 4096};
    CHECK(nq_post_owner_read(&e.q, &r) == 0, "the owner's READ accepted");
    CHECK(on_wire(&e) == 1, "one READ on the wire with one credit, not %llu", (unsigned long long)on_wire(&e));
    CHECK(e.q.py_reads_count == 1, "the owner's READ waits for the credit");
    /* the wire held, each release completes everything on it: the READs it executes were in flight together */
    for (int round = 0; round < 32 && (e.q.nreqs != e.q.nfree || e.q.py_reads_count || on_wire(&e)); round++) {
        uint64_t before = counter(&e, COUNTER_READS);
        fakehost_release(e.dev, ~0u);
        uint64_t together = counter(&e, COUNTER_READS) - before;
        CHECK(together <= 1, "%llu READs in flight with 1 credit", (unsigned long long)together);
        nq_poll(&e.q, 256);
    }
    uint16_t cids[64];
    CHECK(responses(&e, cids, 64) == 4, "the 4 Writes answered");
    CHECK(owner.send_done == 1, "the owner's READ completed");
    CHECK(!memcmp(e.ram + 128 * 4096, e.host + 4096, 4096), "the owner's READ moved its data");
    CHECK(e.q.reads_free == 1 && !e.q.fail_status && owner.failures == 0, "the credit back, nothing failed");
    env_close(&e);
}

static void test_a_read_never_waits_behind_a_write_waiting_for_a_credit(void)
{
    struct env e;
    env_open(&e, 1);
    deliver_io(&e, 0x01, 1, 0, 0, 1);
    deliver_io(&e, 0x01, 1, 8, 4096, 2);
    deliver_io(&e, 0x02, 1, 64, 8192, 3);
    fakehost_hold(e.dev, 1);
    nq_poll(&e.q, 256);
    CHECK(on_wire(&e) == 3, "READ of cid 1, WRITE and SEND of cid 3: %llu", (unsigned long long)on_wire(&e));
    fakehost_release(e.dev, ~0u);
    uint16_t cids[8];
    CHECK(responses(&e, cids, 8) == 1 && cids[0] == 3, "the Read answered first");
    fakehost_hold(e.dev, 0);
    pump(&e);
    CHECK(responses(&e, cids, 8) == 2, "then both Writes");
    env_close(&e);
}

static void test_a_capsule_the_view_does_not_serve_goes_to_the_owner(void)
{
    struct env e;
    env_open(&e, 16);
    deliver_io(&e, 0x02, 2, 0, 0, 11); /* namespace 2 is not in the view */
    pump(&e);
    CHECK(owner.capsules == 1 && owner.last_capsule[2] == 11, "handed to the owner with its capsule");
    uint8_t cqe[16] = {0};
    cqe[12] = 11;
    CHECK(nq_post_owner_response(&e.q, 3, cqe, 1, 0, 0, 0, 0, 0, -1) == 0, "the owner's answer posted");
    pump(&e);
    uint16_t cids[8];
    CHECK(responses(&e, cids, 8) == 1 && cids[0] == 11, "the owner's answer reached the host");
    env_close(&e);
}

static void test_a_close_sends_what_was_batched_first(void)
{
    struct env e;
    env_open(&e, 16);
    for (int i = 0; i < 4; i++)
        deliver_io(&e, 0x02, 1, 8 * i, 4096 * i, (uint16_t)i);
    deliver_io(&e, 0x02, 2, 0, 0, 100); /* for the owner, which answers it and closes the queue in the poll */
    deliver_io(&e, 0x02, 1, 0, 0, 101); /* behind the close: not taken */
    owner.disconnect = 1;
    fakehost_hold(e.dev, 1);
    nq_poll(&e.q, 256);
    CHECK(owner.close_busy == 1, "posted work still to complete at the close");
    CHECK(on_wire(&e) == 4 * 2 + 1, "the Reads' WRITEs and SENDs and the owner's SEND posted: %llu",
          (unsigned long long)on_wire(&e));
    CHECK(!nq_close_ready(&e.q), "not ready while they are on the wire");
    fakehost_hold(e.dev, 0);
    pump(&e);
    CHECK(nq_close_ready(&e.q), "ready once the send queue emptied");
    uint16_t cids[8];
    CHECK(responses(&e, cids, 8) == 5, "the 4 Reads and the Disconnect answered, the capsule behind it not");
    CHECK(e.q.native_commands == 4 && owner.capsules == 1, "nothing taken after the close");
    CHECK(e.q.state == NQ_Q_CLOSING, "closing until its owner closes it: %s", nq_qstate_names[e.q.state]);
    env_close(&e);
}

/* The queue's lifetime (csrc/nq_life.h): the per-command compares rest on the order of the states, and every path
 * from SERVING ends in RELEASED through CLOSED, never back. */
static void test_the_queue_lifetime_table(void)
{
    for (int s = 0; s < NQ_QSTATES; s++) {
        for (int t = 0; t < NQ_QSTATES; t++) {
            int edge = (nq_qnext[s] & NQ_QTO(t)) != 0;
            CHECK(!edge || t > s, "%s -> %s goes back", nq_qstate_names[s], nq_qstate_names[t]);
            CHECK(!edge || t < NQ_Q_RELEASED || s == NQ_Q_CLOSED, "%s -> RELEASED skips CLOSED", nq_qstate_names[s]);
        }
        CHECK(s == NQ_Q_RELEASED || (nq_qnext[s] & (NQ_QTO(NQ_Q_CLOSED) | NQ_QTO(NQ_Q_RELEASED))),
              "%s cannot close", nq_qstate_names[s]);
    }
    CHECK(nq_qnext[NQ_Q_RELEASED] == 0, "RELEASED is the end");
    int st = NQ_Q_SERVING;
    CHECK(nq_qmove(&st, NQ_Q_CLOSING, 1) == 0 && nq_qmove(&st, NQ_Q_FAILED, 1) == 0 &&
          nq_qmove(&st, NQ_Q_STOPPED, 1) == 0 && nq_qmove(&st, NQ_Q_CLOSED, 1) == 0 &&
          nq_qmove(&st, NQ_Q_RELEASED, 1) == 0 && st == NQ_Q_RELEASED, "the longest way, step by step");
}

int main(void)
{
    nq_lat_init();
    test_reads_and_writes_move_their_bytes();
    test_one_read_credit_is_never_used_twice();
    test_a_read_never_waits_behind_a_write_waiting_for_a_credit();
    test_a_capsule_the_view_does_not_serve_goes_to_the_owner();
    test_a_close_sends_what_was_batched_first();
    test_the_queue_lifetime_table();
    if (failures) {
        fprintf(stderr, "%d checks failed\n", failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}
