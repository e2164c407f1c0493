/* The RDMA CM of the native queues, through librdmacm's public API only (rdma_cma.h; docs/native.md, "The CM").
 *
 * A `CmChannel` owns one rdma_event_channel (its fd non-blocking, for the event loop) and every CM id made on it:
 * the listening id, the child ids of connect requests, the active ids of our initiator.  It moves bytes and
 * decides nothing: `events()` takes every pending CM event, copies out what Python needs as plain data (the event
 * type, the id's handle, the peer's and the local address, the private data bytes, the responder resources and
 * initiator depth) and acknowledges it at once, so destroying an id never waits for an unacked event.  Python then
 * decides: `accept`, `reject` (both with the NVMe-oF private data Python packed), `disconnect`, `destroy`.
 *
 * A handle is a number given to an id when it is made (or arrives with a connect request) and never given again
 * in this process, not the id's address: librdmacm may put a new id where a destroyed one was, and a handle
 * Python still holds for the old one (a queue closing late) must not name the new connection.  The channel keeps
 * each id with its handle; every call looks the handle up there first, so a stale or foreign handle is a
 * ValueError, never a wild pointer nor another id.  The native queues' QP helpers (csrc/cm.c, csrc/hostq.c)
 * resolve a handle through its channel the same way (native_cm_id).
 *
 * The functions of librdmacm are called through one table, the real library's by default;
 * `_native.cm_load_library(path)` points it at another library with the same names (the unit tests' fake
 * librdmacm, tests/native/fakecm.c).  None of this is on the per-command path.
 */
#include "native.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

struct cm_ops {
    struct rdma_event_channel *(*create_event_channel)(void);
    void (*destroy_event_channel)(struct rdma_event_channel *);
    int (*create_id)(struct rdma_event_channel *, struct rdma_cm_id **, void *, enum rdma_port_space);
    int (*destroy_id)(struct rdma_cm_id *);
    int (*bind_addr)(struct rdma_cm_id *, struct sockaddr *);
    int (*listen)(struct rdma_cm_id *, int);
    int (*get_cm_event)(struct rdma_event_channel *, struct rdma_cm_event **);
    int (*ack_cm_event)(struct rdma_cm_event *);
    int (*accept)(struct rdma_cm_id *, struct rdma_conn_param *);
    int (*reject)(struct rdma_cm_id *, const void *, uint8_t);
    int (*disconnect)(struct rdma_cm_id *);
    int (*resolve_addr)(struct rdma_cm_id *, struct sockaddr *, struct sockaddr *, int);
    int (*resolve_route)(struct rdma_cm_id *, int);
    int (*connect)(struct rdma_cm_id *, struct rdma_conn_param *);
    int (*init_qp_attr)(struct rdma_cm_id *, struct ibv_qp_attr *, int *);
    int (*establish)(struct rdma_cm_id *);
    /* the QP librdmacm makes on an id (csrc/cm.c, csrc/hostq.c) and its state changes (accept_rts) */
    int (*create_qp)(struct rdma_cm_id *, struct ibv_pd *, struct ibv_qp_init_attr *);
    void (*destroy_qp)(struct rdma_cm_id *);
    int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
};

static struct cm_ops ops = {
    rdma_create_event_channel, rdma_destroy_event_channel, rdma_create_id, rdma_destroy_id, rdma_bind_addr,
    rdma_listen, rdma_get_cm_event, rdma_ack_cm_event, rdma_accept, rdma_reject, rdma_disconnect,
    rdma_resolve_addr, rdma_resolve_route, rdma_connect, rdma_init_qp_attr, rdma_establish,
    rdma_create_qp, rdma_destroy_qp, ibv_modify_qp,
};

struct cm_entry {
    unsigned long long handle;
    struct rdma_cm_id *id;
};

typedef struct {
    PyObject_HEAD
    struct rdma_event_channel *channel;
    struct cm_entry *ids; /* every id made on this channel and not destroyed, with its handle */
    Py_ssize_t n_ids, cap_ids;
    unsigned long long events, created, destroyed, qps_destroyed;
} CmChannel;

/* The last handle given, of any channel: handles are never reused in the process (2**64 of them; all under the
 * GIL), so one names at most one id, on one channel, ever.  0 is never a handle. */
static unsigned long long last_handle;

/* OSError(errno, "what: reason"): its subclass follows errno (ConnectionRefusedError, TimeoutError, ...) */
static PyObject *cm_error(const char *what)
{
    int err = errno ? errno : EIO;
    PyObject *exc = PyObject_CallFunction(PyExc_OSError, "(is)", err, what);
    if (exc) {
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
    }
    return NULL;
}

/* The id kept with a new handle: the handle, or 0 with MemoryError */
static unsigned long long keep_id(CmChannel *self, struct rdma_cm_id *id)
{
    if (self->n_ids == self->cap_ids) {
        Py_ssize_t cap = self->cap_ids ? 2 * self->cap_ids : 16;
        struct cm_entry *ids = PyMem_Realloc(self->ids, cap * sizeof *ids);
        if (!ids) {
            PyErr_NoMemory();
            return 0;
        }
        self->ids = ids;
        self->cap_ids = cap;
    }
    self->ids[self->n_ids].handle = ++last_handle;
    self->ids[self->n_ids].id = id;
    self->n_ids++;
    self->created++;
    return last_handle;
}

/* The index of the id a handle names, or -1 */
static Py_ssize_t find_handle(CmChannel *self, unsigned long long handle)
{
    for (Py_ssize_t i = 0; handle && i < self->n_ids; i++)
        if (self->ids[i].handle == handle)
            return i;
    return -1;
}

/* The handle of one of this channel's ids (an event's), or 0 for none of them */
static unsigned long long handle_of(CmChannel *self, struct rdma_cm_id *id)
{
    for (Py_ssize_t i = 0; id && i < self->n_ids; i++)
        if (self->ids[i].id == id)
            return self->ids[i].handle;
    return 0;
}

/* 0 while the channel is open; else -1 with ValueError */
static int check_open(CmChannel *self)
{
    if (self->channel)
        return 0;
    PyErr_SetString(PyExc_ValueError, "the CM channel is closed");
    return -1;
}

/* The id a handle names, if it is one of this channel's; else NULL with ValueError.  Every method that takes an
 * id goes through here before it touches the id. */
static struct rdma_cm_id *id_arg(CmChannel *self, unsigned long long handle)
{
    if (check_open(self) < 0)
        return NULL;
    Py_ssize_t i = find_handle(self, handle);
    if (i < 0) {
        PyErr_Format(PyExc_ValueError, "CM id %llu is not one of this channel's (destroyed, or never made here)",
                     handle);
        return NULL;
    }
    return self->ids[i].id;
}

/* A handle argument ("O&"): an int that is a handle's value (0 to 2**64 - 1), taken exactly, never modulo 2**64
 * as "K" would (2**64 + h must not name handle h); out of that range it is no handle: the same ValueError */
static int handle_arg(PyObject *obj, void *out)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "a CM id's handle is an int, not %.100s", Py_TYPE(obj)->tp_name);
        return 0;
    }
    unsigned long long handle = PyLong_AsUnsignedLongLong(obj);
    if (handle == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_ValueError, "CM id %S is not one of this channel's (destroyed, or never made here)", obj);
        return 0;
    }
    *(unsigned long long *)out = handle;
    return 1;
}

/* The id of a method whose one argument is an id's handle (id_arg), or NULL with the error */
static struct rdma_cm_id *only_id(CmChannel *self, PyObject *args)
{
    unsigned long long handle;
    return PyArg_ParseTuple(args, "O&", handle_arg, &handle) ? id_arg(self, handle) : NULL;
}

/* A librdmacm call's return (0, or -1 with errno) as a method's answer: None, or cm_error naming the call.
 * CM_CALL clears errno before the call, so one that fails without setting it is EIO, never an older errno. */
static PyObject *cm_answer(int rc, const char *what)
{
    return rc ? cm_error(what) : Py_NewRef(Py_None);
}
#define CM_CALL(call, what) (errno = 0, cm_answer((call), (what)))

/* The id a handle names let go of (its handle is never one of this channel's again); the caller destroys it */
static void forget_handle(CmChannel *self, unsigned long long handle)
{
    Py_ssize_t i = find_handle(self, handle);
    if (i >= 0) {
        self->ids[i] = self->ids[--self->n_ids];
        self->destroyed++;
    }
}

/* "a.b.c.d:port" or "[v6]:port"; "" for another family or no address */
static PyObject *address_text(const struct sockaddr *sa)
{
    char host[INET6_ADDRSTRLEN];
    if (sa && sa->sa_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)sa;
        if (inet_ntop(AF_INET, &in->sin_addr, host, sizeof host))
            return PyUnicode_FromFormat("%s:%u", host, (unsigned)ntohs(in->sin_port));
    } else if (sa && sa->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)sa;
        if (inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof host))
            return PyUnicode_FromFormat("[%s]:%u", host, (unsigned)ntohs(in6->sin6_port));
    }
    return PyUnicode_FromString("");
}

/* host (IPv4 or IPv6 literal) and port into a sockaddr_storage; -1 with ValueError naming the address or port.
 * The numbers of the methods are parsed as long long ("L": OverflowError past it), never "I", which would take
 * 2**32 + 4420 as 4420, and checked against their field here and in conn_param. */
static int parse_address(const char *host, long long port, struct sockaddr_storage *ss)
{
    memset(ss, 0, sizeof *ss);
    struct sockaddr_in *in = (struct sockaddr_in *)ss;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)ss;
    if (port < 0 || port > 65535) {
        PyErr_Format(PyExc_ValueError, "port %lld: out of range (0-65535)", port);
        return -1;
    }
    if (inet_pton(AF_INET, host, &in->sin_addr) == 1) {
        in->sin_family = AF_INET;
        in->sin_port = htons((uint16_t)port);
        return 0;
    }
    if (inet_pton(AF_INET6, host, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons((uint16_t)port);
        return 0;
    }
    PyErr_Format(PyExc_ValueError, "%s: not an IPv4 or IPv6 address (the RDMA CM takes an address, not a name)",
                 host);
    return -1;
}

static PyObject *CmChannel_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    static char *no_keywords[] = {NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, ":CmChannel", no_keywords))
        return NULL;
    CmChannel *self = (CmChannel *)type->tp_alloc(type, 0);
    if (!self)
        return NULL;
    errno = 0;
    self->channel = ops.create_event_channel();
    if (!self->channel) {
        cm_error("rdma_create_event_channel"); /* first: the dealloc may change errno */
        Py_DECREF(self);
        return NULL;
    }
    int flags = fcntl(self->channel->fd, F_GETFL);
    if (flags < 0 || fcntl(self->channel->fd, F_SETFL, flags | O_NONBLOCK) < 0) {
        cm_error("making the CM event channel non-blocking");
        /* not close_channel: no id is on it yet, and taking its events from a blocking fd would wait for one */
        ops.destroy_event_channel(self->channel);
        self->channel = NULL;
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

/* Every pending event acked (a pending connect request rejected), then every id destroyed, then the channel.
 * An id whose QP is still there (its queue was never closed: the owners close theirs first) has the QP destroyed
 * before it: rdma_destroy_id leaves a QP of librdmacm's in place, holding the device's PD. */
static void close_channel(CmChannel *self)
{
    if (!self->channel)
        return;
    struct rdma_cm_event *event;
    while (!ops.get_cm_event(self->channel, &event)) {
        struct rdma_cm_id *child = event->event == RDMA_CM_EVENT_CONNECT_REQUEST ? event->id : NULL;
        ops.ack_cm_event(event);
        if (child) { /* a connect request nobody answered: refused, and its new id is ours to destroy */
            ops.reject(child, NULL, 0);
            ops.destroy_id(child);
            self->created++;
            self->destroyed++;
        }
    }
    while (self->n_ids) {
        struct rdma_cm_id *id = self->ids[--self->n_ids].id;
        if (id->qp) {
            ops.destroy_qp(id);
            self->qps_destroyed++;
        }
        ops.destroy_id(id);
        self->destroyed++;
    }
    ops.destroy_event_channel(self->channel);
    self->channel = NULL;
}

static void CmChannel_dealloc(CmChannel *self)
{
    close_channel(self);
    PyMem_Free(self->ids);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *CmChannel_close(CmChannel *self, PyObject *unused)
{
    close_channel(self);
    Py_RETURN_NONE;
}

static PyObject *CmChannel_fileno(CmChannel *self, PyObject *unused)
{
    return check_open(self) < 0 ? NULL : PyLong_FromLong(self->channel->fd);
}

/* A new active id kept on the channel: its handle (*id the id), or 0 with the error */
static unsigned long long new_id(CmChannel *self, struct rdma_cm_id **id)
{
    *id = NULL;
    if (check_open(self) < 0)
        return 0;
    errno = 0;
    if (ops.create_id(self->channel, id, NULL, RDMA_PS_TCP)) {
        cm_error("rdma_create_id");
        return 0;
    }
    unsigned long long handle = keep_id(self, *id);
    if (!handle)
        ops.destroy_id(*id);
    return handle;
}

/* An id kept a moment ago let go of and destroyed, errno kept for the caller's error */
static void drop_id(CmChannel *self, unsigned long long handle, struct rdma_cm_id *id)
{
    int err = errno;
    forget_handle(self, handle);
    ops.destroy_id(id);
    errno = err;
}

/* listen(address, port, backlog) -> handle of the listening id */
static PyObject *CmChannel_listen(CmChannel *self, PyObject *args)
{
    const char *host;
    long long port;
    int backlog = 128;
    if (!PyArg_ParseTuple(args, "sL|i", &host, &port, &backlog))
        return NULL;
    struct sockaddr_storage ss;
    if (parse_address(host, port, &ss) < 0)
        return NULL;
    struct rdma_cm_id *id;
    unsigned long long handle = new_id(self, &id);
    if (!handle)
        return NULL;
    errno = 0;
    if (ops.bind_addr(id, (struct sockaddr *)&ss)) {
        drop_id(self, handle, id);
        return cm_error("rdma_bind_addr");
    }
    errno = 0;
    if (ops.listen(id, backlog)) {
        drop_id(self, handle, id);
        return cm_error("rdma_listen");
    }
    return PyLong_FromUnsignedLongLong(handle);
}

/* create_id() -> handle of a new active id (our initiator's queue) */
static PyObject *CmChannel_create_id(CmChannel *self, PyObject *unused)
{
    struct rdma_cm_id *id;
    unsigned long long handle = new_id(self, &id);
    return handle ? PyLong_FromUnsignedLongLong(handle) : NULL;
}

/* resolve_addr(id, src or None, address, port, timeout_ms): ADDR_RESOLVED follows */
static PyObject *CmChannel_resolve_addr(CmChannel *self, PyObject *args)
{
    unsigned long long handle;
    const char *src = NULL, *dst;
    long long port;
    int timeout_ms;
    if (!PyArg_ParseTuple(args, "O&zsLi", handle_arg, &handle, &src, &dst, &port, &timeout_ms))
        return NULL;
    struct rdma_cm_id *id = id_arg(self, handle);
    if (!id)
        return NULL;
    struct sockaddr_storage from, to;
    if ((src && *src && parse_address(src, 0, &from) < 0) || parse_address(dst, port, &to) < 0)
        return NULL;
    return CM_CALL(ops.resolve_addr(id, src && *src ? (struct sockaddr *)&from : NULL, (struct sockaddr *)&to,
                                    timeout_ms),
                   "rdma_resolve_addr");
}

/* resolve_route(id, timeout_ms): ROUTE_RESOLVED follows */
static PyObject *CmChannel_resolve_route(CmChannel *self, PyObject *args)
{
    unsigned long long handle;
    int timeout_ms;
    if (!PyArg_ParseTuple(args, "O&i", handle_arg, &handle, &timeout_ms))
        return NULL;
    struct rdma_cm_id *id = id_arg(self, handle);
    return id ? CM_CALL(ops.resolve_route(id, timeout_ms), "rdma_resolve_route") : NULL;
}

static int conn_param(struct rdma_conn_param *param, const Py_buffer *data, long long resources, long long depth,
                      long long qp_num)
{
    memset(param, 0, sizeof *param);
    if (data->len > 255 || resources < 0 || resources > 255 || depth < 0 || depth > 255) {
        PyErr_Format(PyExc_ValueError, "private data of %zd bytes, responder resources %lld, initiator depth %lld: "
                     "each must be 0 to 255", data->len, resources, depth);
        return -1;
    }
    if (qp_num < 0 || qp_num > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "QP number %lld: out of range (0-%u)", qp_num, UINT32_MAX);
        return -1;
    }
    param->private_data = data->buf;
    param->private_data_len = (uint8_t)data->len;
    param->responder_resources = (uint8_t)resources;
    param->initiator_depth = (uint8_t)depth;
    param->flow_control = 1;
    param->retry_count = 7;
    param->rnr_retry_count = 7;
    param->qp_num = (uint32_t)qp_num;
    return 0;
}

/* accept or connect (`call`, named `what`) with (id, private_data, responder_resources, initiator_depth, qp_num=0) */
static PyObject *conn_call(CmChannel *self, PyObject *args, int (*call)(struct rdma_cm_id *, struct rdma_conn_param *),
                           const char *what)
{
    unsigned long long handle;
    Py_buffer data;
    long long resources, depth, qp_num = 0;
    if (!PyArg_ParseTuple(args, "O&y*LL|L", handle_arg, &handle, &data, &resources, &depth, &qp_num))
        return NULL;
    struct rdma_cm_id *id = id_arg(self, handle);
    struct rdma_conn_param param;
    PyObject *out = NULL;
    if (id && conn_param(&param, &data, resources, depth, qp_num) == 0)
        out = CM_CALL(call(id, &param), what);
    PyBuffer_Release(&data);
    return out;
}

static PyObject *CmChannel_accept(CmChannel *self, PyObject *args)
{
    return conn_call(self, args, ops.accept, "rdma_accept");
}

static PyObject *CmChannel_connect(CmChannel *self, PyObject *args)
{
    return conn_call(self, args, ops.connect, "rdma_connect");
}

/* accept_rts(id, private_data, responder_resources, initiator_depth, rnr_retry, max_ack_timeout) -> the RTS
 * attributes set ({rnr_retry, retry_cnt, timeout, max_rd_atomic, min_rnr_timer, max_dest_rd_atomic}): the id's
 * QP (librdmacm's, csrc/cm.c create_cm_qp) taken to RTR and RTS here, then the connection accepted.
 *
 * rdma_accept would take the QP there itself (librdmacm's ucma_modify_qp_rtr and ucma_modify_qp_rts) with
 * rdma_init_qp_attr's values, and on the passive side those come from the host's REQ: the kernel CM's
 * cm_req_handler keeps the REQ's RNR retry count and cm_init_qp_rts_attr sets it as our QP's rnr_retry (the Linux
 * host asks for 7, infinite); the retry count of our own conn_param only travels in the REP, to the host's QP.  So
 * the transitions are made here as librdmacm makes them (INIT again, RTR with our responder resources as
 * max_dest_rd_atomic, RTS with our initiator depth as max_rd_atomic), with rnr_retry and the local ACK timeout
 * bounded (docs/native.md, "The QP's retries"), and rdma_accept is called with id->qp hidden: librdmacm skips its
 * own modifies when id->qp is NULL (as for a QP made outside it) and then takes the QP number from the conn_param.
 * id->qp is put back at once, whatever rdma_accept answered; nothing else looks at it meanwhile (under the GIL). */
static PyObject *CmChannel_accept_rts(CmChannel *self, PyObject *args)
{
    unsigned long long handle;
    Py_buffer data;
    long long resources, depth;
    int rnr_retry, max_timeout;
    if (!PyArg_ParseTuple(args, "O&y*LLii", handle_arg, &handle, &data, &resources, &depth, &rnr_retry,
                          &max_timeout))
        return NULL;
    PyObject *out = NULL;
    struct rdma_cm_id *id = id_arg(self, handle);
    struct rdma_conn_param param;
    if (!id || conn_param(&param, &data, resources, depth, 0) < 0)
        goto done;
    if (!id->qp) {
        PyErr_Format(PyExc_RuntimeError, "CM id %llu has no QP (create_cm_qp first)", handle);
        goto done;
    }
    if (rnr_retry < 0 || rnr_retry > 7 || max_timeout < 1 || max_timeout > 31) {
        PyErr_Format(PyExc_ValueError, "rnr_retry %d (0-7), max_ack_timeout %d (1-31)", rnr_retry, max_timeout);
        goto done;
    }
    struct ibv_qp *qp = id->qp;
    struct ibv_qp_attr attr;
    static const enum ibv_qp_state states[] = {IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS};
    uint8_t dest_rd_atomic = 0, min_rnr_timer = 0;
    for (size_t i = 0; i < sizeof states / sizeof states[0]; i++) {
        int mask = 0;
        memset(&attr, 0, sizeof attr);
        attr.qp_state = states[i];
        errno = 0;
        if (ops.init_qp_attr(id, &attr, &mask)) {
            cm_error("rdma_init_qp_attr");
            goto done;
        }
        if (states[i] == IBV_QPS_RTR) {
            mask &= ~0xe00000; /* as librdmacm on InfiniBand: bits the kernel once set for RoCE, none of verbs' */
            attr.max_dest_rd_atomic = param.responder_resources;
            dest_rd_atomic = attr.max_dest_rd_atomic;
            min_rnr_timer = attr.min_rnr_timer;
        } else if (states[i] == IBV_QPS_RTS) {
            attr.max_rd_atomic = param.initiator_depth;
            attr.rnr_retry = (uint8_t)rnr_retry;
            mask |= IBV_QP_RNR_RETRY;
            if (attr.timeout == 0 || attr.timeout > max_timeout) /* 0: wait for ever for an ACK */
                attr.timeout = (uint8_t)max_timeout;
            mask |= IBV_QP_TIMEOUT;
        }
        int rc = ops.modify_qp(qp, &attr, mask);
        if (rc) {
            errno = rc;
            cm_error(states[i] == IBV_QPS_INIT ? "ibv_modify_qp (INIT)"
                     : states[i] == IBV_QPS_RTR ? "ibv_modify_qp (RTR)" : "ibv_modify_qp (RTS)");
            goto done;
        }
    }
    param.qp_num = qp->qp_num;
    id->qp = NULL; /* librdmacm's rdma_accept: no modify of its own (ucma_modify_qp_rtr/rts return at once) */
    errno = 0;
    int rc = ops.accept(id, &param);
    int err = errno;
    id->qp = qp;
    errno = err;
    if (rc) {
        cm_error("rdma_accept");
        goto done;
    }
    out = Py_BuildValue("{sisisisisisi}", "rnr_retry", (int)attr.rnr_retry, "retry_cnt", (int)attr.retry_cnt,
                        "timeout", (int)attr.timeout, "max_rd_atomic", (int)attr.max_rd_atomic, "min_rnr_timer",
                        (int)min_rnr_timer, "max_dest_rd_atomic", (int)dest_rd_atomic);
done:
    PyBuffer_Release(&data);
    return out;
}

/* reject(id, private_data) */
static PyObject *CmChannel_reject(CmChannel *self, PyObject *args)
{
    unsigned long long handle;
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "O&y*", handle_arg, &handle, &data))
        return NULL;
    struct rdma_cm_id *id = id_arg(self, handle);
    PyObject *out = NULL;
    if (id && data.len > 255)
        PyErr_Format(PyExc_ValueError, "reject private data of %zd bytes: at most 255", data.len);
    else if (id)
        out = CM_CALL(ops.reject(id, data.buf, (uint8_t)data.len), "rdma_reject");
    PyBuffer_Release(&data);
    return out;
}

/* disconnect(id) */
static PyObject *CmChannel_disconnect(CmChannel *self, PyObject *args)
{
    struct rdma_cm_id *id = only_id(self, args);
    return id ? CM_CALL(ops.disconnect(id), "rdma_disconnect") : NULL;
}

/* establish(id): the active side's QP is at RTS after a CONNECT_RESPONSE (a QP made outside librdmacm) */
static PyObject *CmChannel_establish(CmChannel *self, PyObject *args)
{
    struct rdma_cm_id *id = only_id(self, args);
    return id ? CM_CALL(ops.establish(id), "rdma_establish") : NULL;
}

/* destroy(id): its events are all acked by now (events() acks each one), so this never waits.  An id whose QP is
 * still there is refused (RuntimeError, the id kept): its owner destroys the QP first (destroy_cm_qp,
 * destroy_host_qp), once it reaped what the QP flushed; a QP destroyed from here would pull it from under its queue.
 * close() destroys such a QP before its id, as a last resort. */
static PyObject *CmChannel_destroy(CmChannel *self, PyObject *args)
{
    unsigned long long handle;
    if (!PyArg_ParseTuple(args, "O&", handle_arg, &handle))
        return NULL;
    struct rdma_cm_id *id = id_arg(self, handle);
    if (!id)
        return NULL;
    if (id->qp)
        return PyErr_Format(PyExc_RuntimeError, "CM id %llu still has its QP: its queue destroys the QP first",
                            handle);
    forget_handle(self, handle);
    return CM_CALL(ops.destroy_id(id), "rdma_destroy_id");
}

/* device(id) -> the RDMA device's name ("" before the id is bound to one) */
static PyObject *CmChannel_device(CmChannel *self, PyObject *args)
{
    struct rdma_cm_id *id = only_id(self, args);
    if (!id)
        return NULL;
    const char *name = id->verbs && id->verbs->device ? ibv_get_device_name(id->verbs->device) : NULL;
    return PyUnicode_FromString(name ? name : "");
}

/* peer(id) -> "address:port" of the other end ("" when unknown) */
static PyObject *CmChannel_peer(CmChannel *self, PyObject *args)
{
    struct rdma_cm_id *id = only_id(self, args);
    return id ? address_text(rdma_get_peer_addr(id)) : NULL;
}

/* qp_attr(id, state) -> (dict of the ibv_qp_attr fields the CM sets for that state, attribute mask): what a QP
 * made outside librdmacm (the Python data path's, on our own PD) is modified with (rdma_init_qp_attr) */
static PyObject *CmChannel_qp_attr(CmChannel *self, PyObject *args)
{
    unsigned long long handle;
    int state;
    if (!PyArg_ParseTuple(args, "O&i", handle_arg, &handle, &state))
        return NULL;
    struct rdma_cm_id *id = id_arg(self, handle);
    if (!id)
        return NULL;
    struct ibv_qp_attr attr;
    int mask = 0;
    memset(&attr, 0, sizeof attr);
    attr.qp_state = state;
    errno = 0;
    if (ops.init_qp_attr(id, &attr, &mask))
        return cm_error("rdma_init_qp_attr");
    const struct ibv_ah_attr *ah = &attr.ah_attr;
    return Py_BuildValue(
        "({sisIsisisisIsIsIsisisisisisis{sisisisisisisy#sIsisisi}}i)", "qp_state", (int)attr.qp_state,
        "qp_access_flags", attr.qp_access_flags, "pkey_index", (int)attr.pkey_index, "port_num", (int)attr.port_num,
        "path_mtu", (int)attr.path_mtu, "dest_qp_num", attr.dest_qp_num, "rq_psn", attr.rq_psn, "sq_psn",
        attr.sq_psn, "max_dest_rd_atomic", (int)attr.max_dest_rd_atomic, "min_rnr_timer", (int)attr.min_rnr_timer,
        "max_rd_atomic", (int)attr.max_rd_atomic, "timeout", (int)attr.timeout, "retry_cnt", (int)attr.retry_cnt,
        "rnr_retry", (int)attr.rnr_retry, "ah_attr", "is_global", (int)ah->is_global, "dlid", (int)ah->dlid, "sl",
        (int)ah->sl, "src_path_bits", (int)ah->src_path_bits, "static_rate", (int)ah->static_rate, "port_num",
        (int)ah->port_num, "dgid", (const char *)ah->grh.dgid.raw, (Py_ssize_t)16, "flow_label", ah->grh.flow_label,
        "sgid_index", (int)ah->grh.sgid_index, "hop_limit", (int)ah->grh.hop_limit, "traffic_class",
        (int)ah->grh.traffic_class, mask);
}

/* An event as a dict; `handle` is its id's, `listen_handle` a connect request's listening id's (0: none) */
static PyObject *event_dict(struct rdma_cm_event *event, unsigned long long handle, unsigned long long listen_handle)
{
    struct rdma_cm_id *id = event->id;
    const struct rdma_conn_param *conn = &event->param.conn;
    const void *private = conn->private_data;
    Py_ssize_t private_len = private ? conn->private_data_len : 0;
    PyObject *peer = address_text(id ? rdma_get_peer_addr(id) : NULL);
    PyObject *local = address_text(id ? rdma_get_local_addr(id) : NULL);
    PyObject *out = NULL;
    if (peer && local)
        out = Py_BuildValue("{sisKsKsisOsOsy#sisi}", "event", (int)event->event, "id", handle, "listen_id",
                            listen_handle, "status", event->status, "peer", peer,
                            "local", local, "private_data", (const char *)(private ? private : ""), private_len,
                            "responder_resources", (int)conn->responder_resources, "initiator_depth",
                            (int)conn->initiator_depth);
    Py_XDECREF(peer);
    Py_XDECREF(local);
    return out;
}

/* events() -> [dict, ...]: every pending event, copied out and acknowledged; a connect request's new id is kept.
 * rdma_get_cm_event failing after some events were taken returns those (their connect requests would otherwise
 * hold ids nobody answers); it raises only when it took none. */
static PyObject *CmChannel_events(CmChannel *self, PyObject *unused)
{
    if (check_open(self) < 0)
        return NULL;
    PyObject *list = PyList_New(0);
    if (!list)
        return NULL;
    for (;;) {
        struct rdma_cm_event *event;
        errno = 0;
        if (ops.get_cm_event(self->channel, &event)) {
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                break;
            if (PyList_GET_SIZE(list)) /* the events taken are acked: returned, the next call meets the failure */
                break;
            Py_DECREF(list);
            return cm_error("rdma_get_cm_event");
        }
        self->events++;
        struct rdma_cm_id *child = event->event == RDMA_CM_EVENT_CONNECT_REQUEST ? event->id : NULL;
        /* a connect request's new id gets its handle here; any other event's id is one of ours already */
        unsigned long long handle = child ? keep_id(self, child) : handle_of(self, event->id);
        PyObject *item = child && !handle ? NULL : event_dict(event, handle, handle_of(self, event->listen_id));
        ops.ack_cm_event(event);
        if (!item || PyList_Append(list, item) < 0) {
            Py_XDECREF(item);
            if (child) { /* nobody will hear of this id: refuse it here rather than leak it */
                ops.reject(child, NULL, 0);
                if (handle)
                    drop_id(self, handle, child);
                else
                    ops.destroy_id(child);
            }
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
    }
    return list;
}

static PyObject *CmChannel_stats(CmChannel *self, PyObject *unused)
{
    return Py_BuildValue("{snsKsKsKsK}", "ids", self->n_ids, "created", self->created, "destroyed", self->destroyed,
                         "events", self->events, "qps_destroyed", self->qps_destroyed);
}

static PyMethodDef CmChannel_methods[] = {
    {"fileno", (PyCFunction)CmChannel_fileno, METH_NOARGS, "The event channel's fd (non-blocking)."},
    {"close", (PyCFunction)CmChannel_close, METH_NOARGS, "Ack what is pending, destroy every id, then the channel."},
    {"listen", (PyCFunction)CmChannel_listen, METH_VARARGS, "listen(address, port, backlog=128) -> id"},
    {"create_id", (PyCFunction)CmChannel_create_id, METH_NOARGS, "create_id() -> id (an active, RDMA_PS_TCP id)"},
    {"resolve_addr", (PyCFunction)CmChannel_resolve_addr, METH_VARARGS,
     "resolve_addr(id, src or None, address, port, timeout_ms)"},
    {"resolve_route", (PyCFunction)CmChannel_resolve_route, METH_VARARGS, "resolve_route(id, timeout_ms)"},
    {"accept", (PyCFunction)CmChannel_accept, METH_VARARGS,
     "accept(id, private_data, responder_resources, initiator_depth, qp_num=0)"},
    {"accept_rts", (PyCFunction)CmChannel_accept_rts, METH_VARARGS,
     "accept_rts(id, private_data, responder_resources, initiator_depth, rnr_retry, max_ack_timeout) -> RTS "
     "attributes: the id's QP taken to RTR and RTS here (rnr_retry and the ACK timeout bounded), then accepted"},
    {"connect", (PyCFunction)CmChannel_connect, METH_VARARGS,
     "connect(id, private_data, responder_resources, initiator_depth, qp_num=0)"},
    {"reject", (PyCFunction)CmChannel_reject, METH_VARARGS, "reject(id, private_data)"},
    {"disconnect", (PyCFunction)CmChannel_disconnect, METH_VARARGS, "disconnect(id)"},
    {"establish", (PyCFunction)CmChannel_establish, METH_VARARGS, "establish(id)"},
    {"destroy", (PyCFunction)CmChannel_destroy, METH_VARARGS, "destroy(id)"},
    {"device", (PyCFunction)CmChannel_device, METH_VARARGS, "device(id) -> RDMA device name or ''"},
    {"peer", (PyCFunction)CmChannel_peer, METH_VARARGS, "peer(id) -> 'address:port' or ''"},
    {"qp_attr", (PyCFunction)CmChannel_qp_attr, METH_VARARGS,
     "qp_attr(id, state) -> ({ibv_qp_attr fields}, mask) as rdma_init_qp_attr sets them"},
    {"events", (PyCFunction)CmChannel_events, METH_NOARGS, "events() -> pending CM events as dicts, each acked"},
    {"stats", (PyCFunction)CmChannel_stats, METH_NOARGS, "stats() -> {ids, created, destroyed, events}"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CmChannelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "nvmeof_roce._native.CmChannel",
    .tp_basicsize = sizeof(CmChannel),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An RDMA CM event channel and the ids made on it (librdmacm).",
    .tp_new = CmChannel_new,
    .tp_dealloc = (destructor)CmChannel_dealloc,
    .tp_methods = CmChannel_methods,
};

/* The id `handle` (an int) names on `channel`, for the native queues' QP helpers (csrc/cm.c, csrc/hostq.c), which
 * take the CmChannel and the handle from Python: the same checks and errors as every method of the channel
 * (a stale or foreign handle is a ValueError), TypeError for a channel that is not a CmChannel; NULL then. */
struct rdma_cm_id *native_cm_id(PyObject *channel, PyObject *handle)
{
    unsigned long long value;
    if (!PyObject_TypeCheck(channel, &CmChannelType)) {
        PyErr_Format(PyExc_TypeError, "a CM id's channel is a CmChannel, not %.100s", Py_TYPE(channel)->tp_name);
        return NULL;
    }
    return handle_arg(handle, &value) ? id_arg((CmChannel *)channel, value) : NULL;
}

/* The QP librdmacm makes on an id and its destruction, for csrc/cm.c and csrc/hostq.c: through the table, so the
 * unit tests' fake librdmacm makes and destroys them too (and records the order against the id's destruction). */
int native_cm_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_qp_init_attr *attr)
{
    return ops.create_qp(id, pd, attr);
}

void native_cm_destroy_qp(struct rdma_cm_id *id)
{
    ops.destroy_qp(id);
}

/* cm_load_library(path): librdmacm's functions from another library with the same names (the unit tests' fake);
 * every name is resolved before any is used, so a library missing one changes nothing. */
static PyObject *cm_load_library(PyObject *self, PyObject *args)
{
    const char *path;
    if (!PyArg_ParseTuple(args, "s", &path))
        return NULL;
    void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return PyErr_Format(PyExc_OSError, "cannot load %s: %s", path, dlerror());
    static const char *const names[] = {
        "rdma_create_event_channel", "rdma_destroy_event_channel", "rdma_create_id", "rdma_destroy_id",
        "rdma_bind_addr", "rdma_listen", "rdma_get_cm_event", "rdma_ack_cm_event", "rdma_accept", "rdma_reject",
        "rdma_disconnect", "rdma_resolve_addr", "rdma_resolve_route", "rdma_connect", "rdma_init_qp_attr",
        "rdma_establish", "rdma_create_qp", "rdma_destroy_qp", "ibv_modify_qp",
    };
    void *fns[sizeof names / sizeof names[0]];
    _Static_assert(sizeof fns == sizeof(struct cm_ops), "one name per function of cm_ops");
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        fns[i] = dlsym(lib, names[i]);
        if (!fns[i]) {
            dlclose(lib);
            return PyErr_Format(PyExc_OSError, "%s has no %s", path, names[i]);
        }
    }
    memcpy(&ops, fns, sizeof ops);
    Py_RETURN_NONE;
}

static PyMethodDef cm_channel_functions[] = {
    {"cm_load_library", cm_load_library, METH_VARARGS,
     "cm_load_library(path): take librdmacm's functions from another library (the unit tests' fake)."},
    {NULL, NULL, 0, NULL},
};

int native_cm_channel_register(PyObject *module)
{
    static const struct {
        const char *name;
        int value;
    } events[] = {
        {"CM_EVENT_ADDR_RESOLVED", RDMA_CM_EVENT_ADDR_RESOLVED},
        {"CM_EVENT_ADDR_ERROR", RDMA_CM_EVENT_ADDR_ERROR},
        {"CM_EVENT_ROUTE_RESOLVED", RDMA_CM_EVENT_ROUTE_RESOLVED},
        {"CM_EVENT_ROUTE_ERROR", RDMA_CM_EVENT_ROUTE_ERROR},
        {"CM_EVENT_CONNECT_REQUEST", RDMA_CM_EVENT_CONNECT_REQUEST},
        {"CM_EVENT_CONNECT_RESPONSE", RDMA_CM_EVENT_CONNECT_RESPONSE},
        {"CM_EVENT_CONNECT_ERROR", RDMA_CM_EVENT_CONNECT_ERROR},
        {"CM_EVENT_UNREACHABLE", RDMA_CM_EVENT_UNREACHABLE},
        {"CM_EVENT_REJECTED", RDMA_CM_EVENT_REJECTED},
        {"CM_EVENT_ESTABLISHED", RDMA_CM_EVENT_ESTABLISHED},
        {"CM_EVENT_DISCONNECTED", RDMA_CM_EVENT_DISCONNECTED},
        {"CM_EVENT_DEVICE_REMOVAL", RDMA_CM_EVENT_DEVICE_REMOVAL},
        {"CM_EVENT_ADDR_CHANGE", RDMA_CM_EVENT_ADDR_CHANGE},
        {"CM_EVENT_TIMEWAIT_EXIT", RDMA_CM_EVENT_TIMEWAIT_EXIT},
    };
    if (PyType_Ready(&CmChannelType) < 0)
        return -1;
    if (PyModule_AddObjectRef(module, "CmChannel", (PyObject *)&CmChannelType) < 0)
        return -1;
    for (size_t i = 0; i < sizeof events / sizeof events[0]; i++)
        if (PyModule_AddIntConstant(module, events[i].name, events[i].value) < 0)
            return -1;
    return PyModule_AddFunctions(module, cm_channel_functions);
}
