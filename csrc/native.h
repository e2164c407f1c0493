/* nvmeof_roce._native: the per-command data path in C (docs/native.md).
 * Each source file registers its types and functions on the module through one function below. */
#ifndef NVMEOF_ROCE_NATIVE_H
#define NVMEOF_ROCE_NATIVE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

int native_queue_register(PyObject *module);
int native_uring_register(PyObject *module);
int native_hostq_register(PyObject *module);
int native_cm_channel_register(PyObject *module); /* csrc/cm_channel.c: the RDMA CM */
int native_pollgroup_register(PyObject *module); /* csrc/pollgroup.c: _native.PollGroup */
int native_ref_register(PyObject *module); /* csrc/nq_ref.c: _native.Ref */
int native_rbd_register(PyObject *module); /* csrc/nq_rbd.c: _native.RbdImage */
struct nq_ref;
/* The reference a _native.Ref holds (csrc/nq_ref.c), or NULL with TypeError */
struct nq_ref *native_ref_of(PyObject *obj);
struct rdma_cm_id;
/* The id a CmChannel's handle names (csrc/cm_channel.c), or NULL with TypeError or ValueError */
struct rdma_cm_id *native_cm_id(PyObject *channel, PyObject *handle);
struct ibv_pd;
struct ibv_qp_init_attr;
/* rdma_create_qp and rdma_destroy_qp through the CM's table of functions (csrc/cm_channel.c: the fake's in tests) */
int native_cm_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_qp_init_attr *attr);
void native_cm_destroy_qp(struct rdma_cm_id *id);

#endif
