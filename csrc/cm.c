/* The verbs objects of a native queue, made by librdmacm on the connection's CM id (docs/native.md).
 *
 * pyverbs keeps the CM (RdmaListener); it cannot hand its own QPs to C, so for a native queue the QP and its CQs
 * are made here with rdma_create_qp on the child id (id->pd, the device's PD librdmacm keeps, and a send and a
 * receive CQ on their own completion channels); CmChannel.accept_rts (csrc/cm_channel.c) moves the QP to RTR and
 * RTS, with a bounded RNR retry count, and accepts.  Memory the native queue uses is registered on that PD.  The
 * owner destroys the QP (destroy_cm_qp) before the CM id.  None of this is on the per-command path.
 */
#include "native.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <string.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

static int nonblocking(int fd)
{
    int flags = fcntl(fd, F_GETFL);
    return flags < 0 ? -1 : fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

/* create_cm_qp(cm, cm_id, max_send_wr, max_recv_wr, max_inline) -> dict of the addresses and fds; the id is the
 * one the handle `cm_id` names on the CmChannel `cm` (native_cm_id: a stale handle is a ValueError) */
static PyObject *create_cm_qp(PyObject *self, PyObject *args)
{
    PyObject *cm, *handle;
    unsigned int send_wr, recv_wr, inline_size;
    if (!PyArg_ParseTuple(args, "OOIII", &cm, &handle, &send_wr, &recv_wr, &inline_size))
        return NULL;
    struct rdma_cm_id *id = native_cm_id(cm, handle);
    if (!id)
        return NULL;
    if (id->qp) {
        PyErr_SetString(PyExc_RuntimeError, "this CM id already has a QP");
        return NULL;
    }
    struct ibv_qp_init_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.qp_type = IBV_QPT_RC;
    attr.sq_sig_all = 0;
    attr.cap.max_send_wr = send_wr;
    attr.cap.max_recv_wr = recv_wr;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    attr.cap.max_inline_data = inline_size;
    if (native_cm_create_qp(id, NULL, &attr))
        return PyErr_SetFromErrno(PyExc_OSError);
    if (!id->send_cq_channel || !id->recv_cq_channel || nonblocking(id->send_cq_channel->fd) ||
        nonblocking(id->recv_cq_channel->fd)) {
        int err = errno;
        native_cm_destroy_qp(id);
        errno = err ? err : EINVAL;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("{sKsKsKsKsKsKsisisIsI}", "qp", (unsigned long long)(uintptr_t)id->qp, "send_cq",
                         (unsigned long long)(uintptr_t)id->send_cq, "recv_cq",
                         (unsigned long long)(uintptr_t)id->recv_cq, "send_channel",
                         (unsigned long long)(uintptr_t)id->send_cq_channel, "recv_channel",
                         (unsigned long long)(uintptr_t)id->recv_cq_channel, "pd",
                         (unsigned long long)(uintptr_t)id->pd, "send_fd", id->send_cq_channel->fd, "recv_fd",
                         id->recv_cq_channel->fd, "qp_num", id->qp->qp_num, "max_inline",
                         attr.cap.max_inline_data);
}

/* destroy_cm_qp(cm, cm_id) */
static PyObject *destroy_cm_qp(PyObject *self, PyObject *args)
{
    PyObject *cm, *handle;
    if (!PyArg_ParseTuple(args, "OO", &cm, &handle))
        return NULL;
    struct rdma_cm_id *id = native_cm_id(cm, handle);
    if (!id)
        return NULL;
    if (id->qp)
        native_cm_destroy_qp(id); /* the QP, then the CQs and channels librdmacm made with it */
    Py_RETURN_NONE;
}

/* cq_events(channel) -> events taken from a completion channel (non-blocking), each acknowledged */
static PyObject *cq_events(PyObject *self, PyObject *args)
{
    unsigned long long addr;
    if (!PyArg_ParseTuple(args, "K", &addr))
        return NULL;
    struct ibv_comp_channel *channel = (struct ibv_comp_channel *)(uintptr_t)addr;
    int n = 0;
    struct ibv_cq *cq;
    void *context;
    while (!ibv_get_cq_event(channel, &cq, &context)) {
        ibv_ack_cq_events(cq, 1);
        n++;
    }
    return PyLong_FromLong(n);
}

/* reg_mr(pd, addr, length, access) -> (mr, lkey, rkey) */
static PyObject *reg_mr(PyObject *self, PyObject *args)
{
    unsigned long long pd, addr, length;
    int access;
    if (!PyArg_ParseTuple(args, "KKKi", &pd, &addr, &length, &access))
        return NULL;
    struct ibv_mr *mr = ibv_reg_mr((struct ibv_pd *)(uintptr_t)pd, (void *)(uintptr_t)addr, length, access);
    if (!mr)
        return PyErr_SetFromErrno(PyExc_OSError);
    return Py_BuildValue("(KII)", (unsigned long long)(uintptr_t)mr, mr->lkey, mr->rkey);
}

static PyObject *dereg_mr(PyObject *self, PyObject *args)
{
    unsigned long long mr;
    if (!PyArg_ParseTuple(args, "K", &mr))
        return NULL;
    int rc = ibv_dereg_mr((struct ibv_mr *)(uintptr_t)mr);
    if (rc) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_RETURN_NONE;
}

static PyMethodDef cm_methods[] = {
    {"create_cm_qp", create_cm_qp, METH_VARARGS,
     "create_cm_qp(cm, cm_id, max_send_wr, max_recv_wr, max_inline) -> {qp, send_cq, recv_cq, *_channel, *_fd, pd, "
     "...} on the id the handle cm_id names on the CmChannel cm"},
    {"destroy_cm_qp", destroy_cm_qp, METH_VARARGS, "destroy_cm_qp(cm, cm_id): the QP and its CQs."},
    {"cq_events", cq_events, METH_VARARGS, "cq_events(channel) -> completion events taken and acknowledged."},
    {"reg_mr", reg_mr, METH_VARARGS, "reg_mr(pd, addr, length, access) -> (mr, lkey, rkey)."},
    {"dereg_mr", dereg_mr, METH_VARARGS, "dereg_mr(mr)."},
    {NULL, NULL, 0, NULL},
};

int native_cm_register(PyObject *module)
{
    return PyModule_AddFunctions(module, cm_methods);
}
