/* A fake librdmacm for the unit tests of the C CM (csrc/cm_channel.c): no device, no kernel.
 *
 * It exports librdmacm's names (the ones _native.cm_load_library resolves) with the same structs (rdma_cma.h) and
 * keeps what a real CM keeps: event channels whose fd (an eventfd) is readable while events are pending, ids bound
 * to addresses, listeners, child ids made by connect requests.  The test drives the other end with the fakecm_*
 * functions: a connect request from any peer address with any private data, the events a host's CM or the device
 * would cause (DISCONNECTED, TIMEWAIT_EXIT, DEVICE_REMOVAL, ADDR_CHANGE), and it reads what the code under test
 * answered (accept or reject, their private data, responder resources and initiator depth).  An active id
 * (rdma_resolve_addr, rdma_connect) connects to a fake listener in the same process, so both ends of our CM meet.
 * `fakecm_fail_get_event` makes a later rdma_get_cm_event fail, as librdmacm's may (an allocation, the fd's read).
 * The channel's fd is blocking until the code under test makes it not; a rdma_get_cm_event on a blocking channel
 * with no event would wait for ever in librdmacm: the fake counts it (`blocking_waits`), and the tests require 0.
 *
 * Like librdmacm, destroying an id with an event not yet acked would wait for ever: the fake counts it instead
 * (`destroy_unacked`), and the tests require 0.  Ids are never freed (a destroyed id stays readable for the test),
 * only marked destroyed; `fakecm_recycle_next_id` makes the next id take the struct of the id destroyed last, as
 * librdmacm's allocator may put a new id at a destroyed one's address.
 *
 * QPs: rdma_create_qp makes a QP on an id (at INIT, as librdmacm leaves it, with CQs on completion channels whose fds
 * are eventfds) and ibv_modify_qp checks each transition as a device would (INIT to INIT or RTR, RTR to RTS, any to
 * ERR; anything else EINVAL) and keeps what RTR and RTS set.  rdma_accept on an id that has a QP does what
 * librdmacm's does: INIT, RTR and RTS with rdma_init_qp_attr's values (the REQ's RNR retry count, 7) before it
 * accepts.  Each destroy, of a QP or of an id, takes the next number of one sequence, so the test sees which came
 * first (`fakecm_qp`); destroying an id whose QP is still there is counted (`destroy_with_qp`).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <sys/eventfd.h>
#include <rdma/rdma_cma.h>

struct fake_qp {
    struct ibv_qp qp; /* first */
    struct ibv_qp_attr rtr, rts;
    int modifies;
};

struct fake_event {
    struct rdma_cm_event ev;
    uint8_t data[256];
    struct fake_event *next;
};

struct fake_channel {
    struct rdma_event_channel ch; /* first: librdmacm's users read ->fd */
    struct fake_event *head, *tail;
};

struct fake_id {
    struct rdma_cm_id id; /* first */
    struct fake_id *next_all;
    struct fake_id *peer;     /* the other end when both are in this process */
    struct fake_id *listener; /* of a child id */
    int listening, destroyed, unacked;
    int state; /* 0 pending, 1 accepted/established, 2 rejected, 3 disconnected, 4 connecting, 5 connect response */
    uint8_t data[256];
    int data_len, resources, depth;
    int resources_offered; /* the connect request's responder resources (a child id) */
    uint32_t qp_num;
    struct fake_qp *qp_kept;  /* its QP, kept readable once destroyed */
    long qp_destroyed_at, destroyed_at; /* the destroys' places in one sequence (0: not destroyed) */
};

static struct fake_id *all_ids;
/* ids live, ids destroyed, events posted, events acked, destroy_unacked, rejects, blocking_waits, destroy_with_qp,
 * QPs made, QPs destroyed */
static long counters[10];
static long destroys; /* the sequence of destroys, of QPs and of ids */
static int next_channel_fd_bad; /* fakecm_bad_channel_fd */
static struct fake_id *last_destroyed, *recycle; /* fakecm_recycle_next_id: the next new id is `recycle` */

static struct fake_id *fid(struct rdma_cm_id *id) { return (struct fake_id *)id; }

static void post(struct fake_id *f, enum rdma_cm_event_type type, int status, const void *data, int len,
                 int resources, int depth)
{
    struct fake_channel *c = (struct fake_channel *)f->id.channel;
    struct fake_event *e = calloc(1, sizeof *e);
    e->ev.id = &f->id;
    e->ev.listen_id = f->listener ? &f->listener->id : NULL;
    e->ev.event = type;
    e->ev.status = status;
    if (len > 0) {
        memcpy(e->data, data, len);
        e->ev.param.conn.private_data = e->data;
        e->ev.param.conn.private_data_len = (uint8_t)len;
    }
    e->ev.param.conn.responder_resources = (uint8_t)resources;
    e->ev.param.conn.initiator_depth = (uint8_t)depth;
    if (c->tail)
        c->tail->next = e;
    else
        c->head = e;
    c->tail = e;
    counters[2]++;
    uint64_t one = 1;
    (void)!write(c->ch.fd, &one, sizeof one);
}

struct rdma_event_channel *rdma_create_event_channel(void)
{
    struct fake_channel *c = calloc(1, sizeof *c);
    c->ch.fd = next_channel_fd_bad ? -1 : eventfd(0, EFD_CLOEXEC); /* blocking, as librdmacm's */
    next_channel_fd_bad = 0;
    return &c->ch;
}

void rdma_destroy_event_channel(struct rdma_event_channel *channel)
{
    struct fake_channel *c = (struct fake_channel *)channel;
    while (c->head) {
        struct fake_event *e = c->head;
        c->head = e->next;
        free(e);
    }
    if (c->ch.fd >= 0)
        close(c->ch.fd);
    free(c);
}

static struct fake_id *new_id(struct rdma_event_channel *channel)
{
    struct fake_id *f = recycle;
    if (f) { /* already on all_ids: made anew in place */
        struct fake_id *next_all = f->next_all;
        memset(f, 0, sizeof *f);
        f->next_all = next_all;
        recycle = last_destroyed = NULL;
    } else {
        f = calloc(1, sizeof *f);
        f->next_all = all_ids;
        all_ids = f;
    }
    f->id.channel = channel;
    f->id.ps = RDMA_PS_TCP;
    counters[0]++;
    return f;
}

int rdma_create_id(struct rdma_event_channel *channel, struct rdma_cm_id **id, void *context,
                   enum rdma_port_space ps)
{
    struct fake_id *f = new_id(channel);
    f->id.context = context;
    *id = &f->id;
    return 0;
}

int rdma_destroy_id(struct rdma_cm_id *id)
{
    struct fake_id *f = fid(id);
    if (f->destroyed) {
        errno = EINVAL;
        return -1;
    }
    if (f->unacked)
        counters[4]++;
    if (id->qp)
        counters[7]++;
    f->destroyed_at = ++destroys;
    f->destroyed = 1;
    f->listening = 0;
    if (f->peer)
        f->peer->peer = NULL;
    last_destroyed = f;
    counters[0]--;
    counters[1]++;
    return 0;
}

static int same_address(const struct sockaddr *a, const struct sockaddr *b)
{
    if (a->sa_family != b->sa_family)
        return 0;
    if (a->sa_family == AF_INET) {
        const struct sockaddr_in *x = (const void *)a, *y = (const void *)b;
        return x->sin_port == y->sin_port && x->sin_addr.s_addr == y->sin_addr.s_addr;
    }
    if (a->sa_family == AF_INET6) {
        const struct sockaddr_in6 *x = (const void *)a, *y = (const void *)b;
        return x->sin6_port == y->sin6_port && !memcmp(&x->sin6_addr, &y->sin6_addr, 16);
    }
    return 0;
}

static struct fake_id *listener_at(const struct sockaddr *sa)
{
    for (struct fake_id *f = all_ids; f; f = f->next_all)
        if (f->listening && !f->destroyed && same_address(&f->id.route.addr.src_addr, sa))
            return f;
    return NULL;
}

static socklen_t sa_len(const struct sockaddr *sa)
{
    return sa->sa_family == AF_INET6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
}

int rdma_bind_addr(struct rdma_cm_id *id, struct sockaddr *addr)
{
    if (addr->sa_family != AF_INET && addr->sa_family != AF_INET6) {
        errno = EAFNOSUPPORT;
        return -1;
    }
    memcpy(&id->route.addr.src_addr, addr, sa_len(addr));
    return 0;
}

int rdma_listen(struct rdma_cm_id *id, int backlog)
{
    if (listener_at(&id->route.addr.src_addr)) {
        errno = EADDRINUSE;
        return -1;
    }
    fid(id)->listening = 1;
    return 0;
}

static int get_event_fails_in, get_event_errno; /* fakecm_fail_get_event */

int rdma_get_cm_event(struct rdma_event_channel *channel, struct rdma_cm_event **event)
{
    struct fake_channel *c = (struct fake_channel *)channel;
    if (get_event_fails_in && !--get_event_fails_in) { /* as librdmacm's own failures: nothing taken */
        errno = get_event_errno;
        return -1;
    }
    if (!c->head) {
        int flags = fcntl(c->ch.fd, F_GETFL);
        if (flags < 0 || !(flags & O_NONBLOCK)) /* librdmacm would wait for an event here: counted instead */
            counters[6]++;
        uint64_t n;
        (void)!read(c->ch.fd, &n, sizeof n);
        errno = EAGAIN;
        return -1;
    }
    struct fake_event *e = c->head;
    c->head = e->next;
    if (!c->head)
        c->tail = NULL;
    fid(e->ev.id)->unacked++;
    *event = &e->ev;
    return 0;
}

int rdma_ack_cm_event(struct rdma_cm_event *event)
{
    fid(event->id)->unacked--;
    counters[3]++;
    free(event); /* the event is the first member of fake_event */
    return 0;
}

static void record(struct fake_id *f, struct rdma_conn_param *param)
{
    f->data_len = param ? param->private_data_len : 0;
    if (f->data_len)
        memcpy(f->data, param->private_data, f->data_len);
    f->resources = param ? param->responder_resources : 0;
    f->depth = param ? param->initiator_depth : 0;
    f->qp_num = param ? param->qp_num : 0;
}

static int modify_as_librdmacm(struct rdma_cm_id *id, const struct rdma_conn_param *param);

int rdma_accept(struct rdma_cm_id *id, struct rdma_conn_param *param)
{
    struct fake_id *f = fid(id);
    if (f->state != 0 || !f->listener) {
        errno = EINVAL;
        return -1;
    }
    if (id->qp && modify_as_librdmacm(id, param)) /* librdmacm's ucma_modify_qp_rtr and ucma_modify_qp_rts */
        return -1;
    record(f, param);
    if (id->qp)
        f->qp_num = id->qp->qp_num; /* librdmacm takes the QP's number over the conn_param's */
    f->state = 1;
    if (f->peer && f->peer->qp_num) { /* the host's QP is its own: it answers with rdma_establish */
        f->peer->state = 5;
        post(f->peer, RDMA_CM_EVENT_CONNECT_RESPONSE, 0, f->data, f->data_len, f->resources, f->depth);
        return 0;
    }
    post(f, RDMA_CM_EVENT_ESTABLISHED, 0, NULL, 0, 0, 0);
    if (f->peer) { /* the host's QP is librdmacm's (rdma_create_qp): RTR and RTS by itself */
        f->peer->state = 1;
        post(f->peer, RDMA_CM_EVENT_ESTABLISHED, 0, f->data, f->data_len, f->resources, f->depth);
    }
    return 0;
}

int rdma_reject(struct rdma_cm_id *id, const void *data, uint8_t len)
{
    struct fake_id *f = fid(id);
    if (f->state != 0) {
        errno = EINVAL;
        return -1;
    }
    f->data_len = len;
    if (len)
        memcpy(f->data, data, len);
    f->state = 2;
    counters[5]++;
    if (f->peer)
        post(f->peer, RDMA_CM_EVENT_REJECTED, 28 /* IB_CM_REJ_CONSUMER_DEFINED */, f->data, len, 0, 0);
    return 0;
}

int rdma_disconnect(struct rdma_cm_id *id)
{
    struct fake_id *f = fid(id);
    if (f->state != 1) {
        errno = EINVAL;
        return -1;
    }
    f->state = 3;
    post(f, RDMA_CM_EVENT_DISCONNECTED, 0, NULL, 0, 0, 0);
    if (f->peer && f->peer->state == 1) {
        f->peer->state = 3;
        post(f->peer, RDMA_CM_EVENT_DISCONNECTED, 0, NULL, 0, 0, 0);
    }
    return 0;
}

int rdma_resolve_addr(struct rdma_cm_id *id, struct sockaddr *src, struct sockaddr *dst, int timeout_ms)
{
    static uint16_t next_port = 50000;
    struct sockaddr_in *me = (struct sockaddr_in *)&id->route.addr.src_addr;
    memcpy(&id->route.addr.dst_addr, dst, sa_len(dst));
    if (src) {
        memcpy(me, src, sa_len(src));
    } else {
        me->sin_family = AF_INET;
        inet_pton(AF_INET, "10.0.0.99", &me->sin_addr);
    }
    me->sin_port = htons(next_port++);
    post(fid(id), listener_at(dst) ? RDMA_CM_EVENT_ADDR_RESOLVED : RDMA_CM_EVENT_ADDR_ERROR,
         listener_at(dst) ? 0 : -EHOSTUNREACH, NULL, 0, 0, 0);
    return 0;
}

int rdma_resolve_route(struct rdma_cm_id *id, int timeout_ms)
{
    post(fid(id), RDMA_CM_EVENT_ROUTE_RESOLVED, 0, NULL, 0, 0, 0);
    return 0;
}

static struct fake_id *request(struct fake_id *listener, const struct sockaddr *peer, const void *data, int len,
                               int resources, int depth)
{
    struct fake_id *child = new_id(listener->id.channel);
    child->listener = listener;
    child->resources_offered = resources;
    memcpy(&child->id.route.addr.src_addr, &listener->id.route.addr.src_addr,
           sa_len(&listener->id.route.addr.src_addr));
    memcpy(&child->id.route.addr.dst_addr, peer, sa_len(peer));
    post(child, RDMA_CM_EVENT_CONNECT_REQUEST, 0, data, len, resources, depth);
    return child;
}

int rdma_connect(struct rdma_cm_id *id, struct rdma_conn_param *param)
{
    struct fake_id *f = fid(id);
    struct fake_id *listener = listener_at(&id->route.addr.dst_addr);
    if (!listener) {
        post(f, RDMA_CM_EVENT_UNREACHABLE, -ETIMEDOUT, NULL, 0, 0, 0);
        return 0;
    }
    record(f, param);
    f->state = 4;
    struct fake_id *child = request(listener, &id->route.addr.src_addr, f->data, f->data_len, f->resources,
                                    f->depth);
    child->peer = f;
    f->peer = child;
    return 0;
}

/* --- the test's end ---------------------------------------------------------------------------------------- */

static int fill(struct sockaddr_storage *ss, const char *host, unsigned port)
{
    memset(ss, 0, sizeof *ss);
    struct sockaddr_in *in = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
    if (inet_pton(AF_INET, host, &in->sin_addr) == 1) {
        in->sin_family = AF_INET;
        in->sin_port = htons(port);
        return 0;
    }
    if (inet_pton(AF_INET6, host, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(port);
        return 0;
    }
    return -1;
}

/* A connect request from peer:peer_port to the listener on host:port; the child id, or NULL if none listens. */
void *fakecm_connect(const char *host, unsigned port, const char *peer, unsigned peer_port, const void *data,
                     int len, int resources, int depth)
{
    struct sockaddr_storage at, from;
    if (fill(&at, host, port) || fill(&from, peer, peer_port))
        return NULL;
    struct fake_id *listener = listener_at((struct sockaddr *)&at);
    return listener ? &request(listener, (struct sockaddr *)&from, data, len, resources, depth)->id : NULL;
}

/* An event on an id, as its peer's CM or the device would cause it: 0, or -1 for an id destroyed already. */
int fakecm_event(void *id, int type, int status)
{
    struct fake_id *f = id;
    if (f->destroyed)
        return -1;
    if (type == RDMA_CM_EVENT_DISCONNECTED)
        f->state = 3;
    post(f, type, status, NULL, 0, 0, 0);
    return 0;
}

/* What the code under test answered on an id: state (0 none yet, 1 accepted, 2 rejected, 3 disconnected,
 * 4 connecting, 5 connect response taken; -1 destroyed), the private data it sent, its responder resources, initiator depth, QP number. */
int fakecm_answer(void *id, uint8_t *data, int *len, int *resources, int *depth, uint32_t *qp_num)
{
    struct fake_id *f = id;
    memcpy(data, f->data, f->data_len);
    *len = f->data_len;
    *resources = f->resources;
    *depth = f->depth;
    *qp_num = f->qp_num;
    return f->destroyed ? -1 : f->state;
}

/* The next rdma_create_event_channel gives a channel whose fd is not open (-1): making it non-blocking fails. */
void fakecm_bad_channel_fd(void)
{
    next_channel_fd_bad = 1;
}

/* The next id made (by rdma_create_id or a connect request) takes the struct, so the address, of the id destroyed
 * last: -1 if none was destroyed since the last recycling, else 0. */
int fakecm_recycle_next_id(void)
{
    recycle = last_destroyed;
    return recycle ? 0 : -1;
}

/* The nth rdma_get_cm_event from now (1: the next) fails with errno `err`, taking no event. */
void fakecm_fail_get_event(int nth, int err)
{
    get_event_fails_in = nth;
    get_event_errno = err;
}

/* An id's QP as it is (or was when destroyed): its state (-1: it never had one), what RTR and RTS set, the modifies
 * made, and where its destroy and the id's fell in the sequence of destroys (0: not yet).  out: state, modifies,
 * rtr max_dest_rd_atomic, rtr min_rnr_timer, rts rnr_retry, rts retry_cnt, rts timeout, rts max_rd_atomic, qp
 * destroyed at, id destroyed at, qp_num. */
int fakecm_qp(void *id, long *out)
{
    struct fake_id *f = id;
    struct fake_qp *q = f->qp_kept;
    memset(out, 0, 11 * sizeof *out);
    out[8] = f->qp_destroyed_at;
    out[9] = f->destroyed_at;
    if (!q)
        return -1;
    out[0] = q->qp.state;
    out[1] = q->modifies;
    out[2] = q->rtr.max_dest_rd_atomic;
    out[3] = q->rtr.min_rnr_timer;
    out[4] = q->rts.rnr_retry;
    out[5] = q->rts.retry_cnt;
    out[6] = q->rts.timeout;
    out[7] = q->rts.max_rd_atomic;
    out[10] = q->qp.qp_num;
    return 0;
}

void fakecm_counters(long *out)
{
    memcpy(out, counters, sizeof counters);
}

/* What librdmacm computes from the route: plausible RoCE values, the connect request's resources as max_rd_atomic. */
int rdma_init_qp_attr(struct rdma_cm_id *id, struct ibv_qp_attr *attr, int *mask)
{
    struct fake_id *f = fid(id);
    attr->port_num = 1;
    attr->pkey_index = 0;
    switch (attr->qp_state) {
    case IBV_QPS_INIT:
        attr->qp_access_flags = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
        *mask = IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
        return 0;
    case IBV_QPS_RTR:
        attr->path_mtu = IBV_MTU_1024;
        attr->dest_qp_num = 0x99;
        attr->rq_psn = 0x1234;
        attr->max_dest_rd_atomic = 16;
        attr->min_rnr_timer = 12;
        attr->ah_attr.is_global = 1;
        attr->ah_attr.port_num = 1;
        attr->ah_attr.grh.hop_limit = 64;
        attr->ah_attr.grh.dgid.raw[10] = attr->ah_attr.grh.dgid.raw[11] = 0xff;
        memcpy(&attr->ah_attr.grh.dgid.raw[12], &((struct sockaddr_in *)&id->route.addr.dst_addr)->sin_addr, 4);
        *mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        return 0;
    case IBV_QPS_RTS:
        attr->sq_psn = 0x1234;
        attr->timeout = 14;
        attr->retry_cnt = 7;
        attr->rnr_retry = 7;
        attr->max_rd_atomic = (uint8_t)f->resources_offered;
        *mask = IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                IBV_QP_MAX_QP_RD_ATOMIC;
        return 0;
    default:
        errno = EINVAL;
        return -1;
    }
}

/* The active side after CONNECT_RESPONSE (a QP made outside librdmacm): the passive side sees ESTABLISHED. */
int rdma_establish(struct rdma_cm_id *id)
{
    struct fake_id *f = fid(id);
    if (f->state != 5) {
        errno = EINVAL;
        return -1;
    }
    f->state = 1;
    if (f->peer) {
        post(f->peer, RDMA_CM_EVENT_ESTABLISHED, 0, NULL, 0, 0, 0);
    }
    return 0;
}

/* --- QPs ------------------------------------------------------------------------------------------------------ */

static struct ibv_pd fake_pd;

static struct ibv_comp_channel *new_channel(void)
{
    struct ibv_comp_channel *c = calloc(1, sizeof *c);
    c->fd = eventfd(0, EFD_CLOEXEC);
    return c;
}

/* librdmacm's: a QP on the id with a send and a receive CQ on their own channels, moved to INIT. */
int rdma_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
    static uint32_t next_qpn = 0x100;
    struct fake_id *f = fid(id);
    if (id->qp || f->destroyed) {
        errno = EINVAL;
        return -1;
    }
    struct fake_qp *q = calloc(1, sizeof *q);
    q->qp.qp_num = next_qpn++;
    q->qp.qp_type = IBV_QPT_RC;
    q->qp.state = IBV_QPS_INIT;
    q->qp.pd = pd ? pd : &fake_pd;
    id->send_cq_channel = new_channel();
    id->recv_cq_channel = new_channel();
    id->send_cq = calloc(1, sizeof *id->send_cq);
    id->recv_cq = calloc(1, sizeof *id->recv_cq);
    id->send_cq->channel = id->send_cq_channel;
    id->recv_cq->channel = id->recv_cq_channel;
    id->pd = q->qp.pd;
    id->qp = &q->qp;
    f->qp_kept = q;
    counters[8]++;
    return 0;
}

void rdma_destroy_qp(struct rdma_cm_id *id)
{
    struct fake_id *f = fid(id);
    if (!id->qp)
        return;
    id->qp->state = IBV_QPS_RESET; /* the kept copy reads as destroyed */
    id->qp = NULL;
    f->qp_destroyed_at = ++destroys;
    close(id->send_cq_channel->fd);
    close(id->recv_cq_channel->fd);
    free(id->send_cq_channel);
    free(id->recv_cq_channel);
    free(id->send_cq);
    free(id->recv_cq);
    id->send_cq_channel = id->recv_cq_channel = NULL;
    id->send_cq = id->recv_cq = NULL;
    counters[9]++;
}

/* A device's checks of a state change: INIT to INIT or RTR, RTR to RTS, RTS to RTS, anything to ERR or RESET. */
int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask)
{
    struct fake_qp *q = (struct fake_qp *)qp;
    enum ibv_qp_state from = qp->state, to = (mask & IBV_QP_STATE) ? attr->qp_state : from;
    int ok = to == IBV_QPS_ERR || to == IBV_QPS_RESET || (from == IBV_QPS_INIT && to == IBV_QPS_INIT) ||
             (from == IBV_QPS_INIT && to == IBV_QPS_RTR) || (from == IBV_QPS_RTR && to == IBV_QPS_RTS) ||
             (from == IBV_QPS_RTS && to == IBV_QPS_RTS);
    if (!ok)
        return EINVAL; /* as ibv_modify_qp: the error number, not -1 */
    if (to == IBV_QPS_RTR)
        q->rtr = *attr;
    if (to == IBV_QPS_RTS && from == IBV_QPS_RTR)
        q->rts = *attr;
    qp->state = to;
    q->modifies++;
    return 0;
}

static int modify_as_librdmacm(struct rdma_cm_id *id, const struct rdma_conn_param *param)
{
    static const enum ibv_qp_state states[] = {IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS};
    for (int i = 0; i < 3; i++) {
        struct ibv_qp_attr attr;
        int mask;
        memset(&attr, 0, sizeof attr);
        attr.qp_state = states[i];
        rdma_init_qp_attr(id, &attr, &mask);
        if (states[i] == IBV_QPS_RTR && param)
            attr.max_dest_rd_atomic = param->responder_resources;
        if (states[i] == IBV_QPS_RTS && param)
            attr.max_rd_atomic = param->initiator_depth;
        int rc = ibv_modify_qp(id->qp, &attr, mask);
        if (rc) {
            errno = rc;
            return -1;
        }
    }
    return 0;
}
