/* A native queue's view on the Python side (csrc/nq_view.c), for its type (csrc/nq_type.c). */
#ifndef NQ_VIEW_H
#define NQ_VIEW_H

#include "native.h"

struct nq_queue;
struct nq_view;

/* set_view's namespaces ((nsid, kind, lbads, num_blocks, addr, lkey, generation, owner[, file]) each) as a new
 * view, checked and sorted by nsid; NULL with a Python error.  The queue is only read (its io_uring and bounce
 * chunk size, for a file namespace). */
struct nq_view *nq_view_build(struct nq_queue *q, int ready, unsigned int max_transfer, PyObject *list);
/* The view and the owners it keeps (NULL: nothing). */
void nq_view_free(struct nq_view *view);
/* {nsid: (reads, writes, flushes, bytes_read, bytes_written, read_latency, write_latency)} of the view (an empty
 * dict for NULL), its counters and histograms zeroed. */
PyObject *nq_drain_stats(struct nq_view *view);

#endif
