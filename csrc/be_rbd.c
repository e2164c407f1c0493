/* The RBD backend's C entry (csrc/backend.h; Python: engine/backends/rbd.py, docs/rbd.md "The native path"):
 * staged, through librbd's C API.  A Read is rbd_aio_read into the command's bounce chunk, then the queue's RDMA
 * WRITE to the host; a Write's data comes into the chunk by RDMA READ (or from the capsule), then rbd_aio_write
 * from it.  Flush is rbd_aio_flush; Write Zeroes is rbd_aio_write_zeroes, with DEAC too (librbd deallocates where
 * it can and reads give zeros either way); rbd_aio_discard only stands in for it, with DEAC, on a librbd without
 * rbd_aio_write_zeroes.  FUA needs nothing: the client runs with rbd_cache=false (engine/backends/rbd.py sets the
 * same options), so a write librbd completes is on the OSDs.
 *
 * librbd and librados are loaded with dlopen into a table of the calls used (one per library path), so the module
 * imports without Ceph and a test can load a fake (tests/unit/fakerbd/).  A handle (`struct nq_rbd`, the queue's
 * `nq_file`) is one RADOS client, pool context and open image, per namespace, shared by its queues.
 *
 * Completions: librbd calls rbd_cb on its own thread.  Each queue has one `rbd_q` (made when its first rbd
 * namespace enters its view: `attach`): a callback argument per request slot, and an array of finished (slot,
 * result) sized by the slots (a slot has at most one call out), under a mutex; the callback appends, and when the
 * array was empty writes the queue's ring eventfd (a dup: the one the event loop watches for the io_uring's
 * completions, so the owner needs nothing new).  The queue's poll takes the array whole (`reap`, every poll, as
 * the io_uring's) and finishes each command there: no Python, and nothing allocated per command on our side
 * (librbd's rbd_aio_create_completion allocates inside librbd).
 *
 * Errors: ETIMEDOUT (rados_osd_op_timeout: the cluster did not answer) is answered ANA Transition, ESHUTDOWN (the
 * cluster blocklisted this client) ANA Inaccessible, both without DNR, as engine/io.py device_status; any other
 * error goes to the core, which does the command again on the reference path and answers with its own status and
 * error log entry (as the io_uring entry's).
 *
 * Closing: a queue that closes with calls still out (`closed`) orphans its rbd_q: their callbacks no longer queue
 * anything, only count down and wake the owner, who keeps the bounce chunks (librbd may still write a Read's) and
 * the ring's eventfd until the count is 0 (the owner's reap_closed: it never waits).  A queue freed before then
 * (`final`) leaves the rbd_q to its last callback.  The handle's image is closed with its last reference once its
 * calls are back; with calls still out, by a thread of its own that waits for them (librbd's op timeout bounds
 * that), never on the event loop. */
#include "be_rbd.h"
#include "backend.h"
#include "nq_hot.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define SC_ANA_INACCESSIBLE 0x302 /* path related: nvme/status.py ANA_INACCESSIBLE */
#define SC_ANA_TRANSITION 0x303   /* nvme/status.py ANA_TRANSITION */

typedef void *rados_t;
typedef void *rados_ioctx_t;
typedef void *rbd_image_t;
typedef void *rbd_completion_t;
typedef void (*rbd_callback_t)(rbd_completion_t cb, void *arg);

/* The calls used, from librados and librbd (their C API: rados/librados.h, rbd/librbd.h). */
struct rbd_lib {
    char rados_path[256], rbd_path[256];
    int (*rados_create2)(rados_t *, const char *, const char *, uint64_t);
    int (*rados_conf_read_file)(rados_t, const char *);
    int (*rados_conf_set)(rados_t, const char *, const char *);
    int (*rados_connect)(rados_t);
    void (*rados_shutdown)(rados_t);
    int (*rados_ioctx_create)(rados_t, const char *, rados_ioctx_t *);
    void (*rados_ioctx_destroy)(rados_ioctx_t);
    void (*rados_ioctx_set_namespace)(rados_ioctx_t, const char *);
    int (*rbd_open)(rados_ioctx_t, const char *, rbd_image_t *, const char *);
    int (*rbd_close)(rbd_image_t);
    int (*rbd_get_size)(rbd_image_t, uint64_t *);
    int (*rbd_aio_create_completion)(void *, rbd_callback_t, rbd_completion_t *);
    ssize_t (*rbd_aio_get_return_value)(rbd_completion_t);
    void (*rbd_aio_release)(rbd_completion_t);
    int (*rbd_aio_read)(rbd_image_t, uint64_t, size_t, char *, rbd_completion_t);
    int (*rbd_aio_write)(rbd_image_t, uint64_t, size_t, const char *, rbd_completion_t);
    int (*rbd_aio_flush)(rbd_image_t, rbd_completion_t);
    int (*rbd_aio_discard)(rbd_image_t, uint64_t, uint64_t, rbd_completion_t);
    int (*rbd_aio_write_zeroes)(rbd_image_t, uint64_t, size_t, rbd_completion_t, int, int); /* optional */
};

#define RBD_LIBS 4 /* library paths one process loads (the real one, a test's fake) */
static struct rbd_lib rbd_libs[RBD_LIBS];
static int rbd_nlibs;
static pthread_mutex_t rbd_libs_lock = PTHREAD_MUTEX_INITIALIZER;

/* The table for these paths, loaded once (never unloaded), or NULL with dlerror's words in err. */
static const struct rbd_lib *rbd_lib_load(const char *rados_path, const char *rbd_path, char *err, size_t errlen)
{
    const struct rbd_lib *found = NULL;
    pthread_mutex_lock(&rbd_libs_lock);
    for (int i = 0; i < rbd_nlibs && !found; i++)
        if (!strcmp(rbd_libs[i].rados_path, rados_path) && !strcmp(rbd_libs[i].rbd_path, rbd_path))
            found = &rbd_libs[i];
    if (found || rbd_nlibs == RBD_LIBS || strlen(rados_path) >= 256 || strlen(rbd_path) >= 256) {
        if (!found)
            snprintf(err, errlen, "too many librbd paths, or a path too long");
        pthread_mutex_unlock(&rbd_libs_lock);
        return found;
    }
    struct rbd_lib lib;
    memset(&lib, 0, sizeof lib);
    void *hr = dlopen(rados_path, RTLD_NOW | RTLD_LOCAL);
    void *hb = hr ? dlopen(rbd_path, RTLD_NOW | RTLD_LOCAL) : NULL;
    if (!hb) {
        snprintf(err, errlen, "cannot load %s: %s", hr ? rbd_path : rados_path, dlerror());
        if (hr)
            dlclose(hr);
        pthread_mutex_unlock(&rbd_libs_lock);
        return NULL;
    }
    const char *missing = NULL;
#define SYM(h, name)                                                                                               \
    do {                                                                                                           \
        *(void **)&lib.name = dlsym(h, #name);                                                                     \
        if (!lib.name && !missing)                                                                                 \
            missing = #name;                                                                                       \
    } while (0)
    SYM(hr, rados_create2);
    SYM(hr, rados_conf_read_file);
    SYM(hr, rados_conf_set);
    SYM(hr, rados_connect);
    SYM(hr, rados_shutdown);
    SYM(hr, rados_ioctx_create);
    SYM(hr, rados_ioctx_destroy);
    SYM(hr, rados_ioctx_set_namespace);
    SYM(hb, rbd_open);
    SYM(hb, rbd_close);
    SYM(hb, rbd_get_size);
    SYM(hb, rbd_aio_create_completion);
    SYM(hb, rbd_aio_get_return_value);
    SYM(hb, rbd_aio_release);
    SYM(hb, rbd_aio_read);
    SYM(hb, rbd_aio_write);
    SYM(hb, rbd_aio_flush);
    SYM(hb, rbd_aio_discard);
#undef SYM
    *(void **)&lib.rbd_aio_write_zeroes = dlsym(hb, "rbd_aio_write_zeroes"); /* librbd 15 (Octopus) on */
    if (missing) {
        snprintf(err, errlen, "%s has no %s", strncmp(missing, "rados", 5) ? rbd_path : rados_path, missing);
        pthread_mutex_unlock(&rbd_libs_lock);
        return NULL; /* the libraries stay loaded: dlclose of librados is not safe once it ran */
    }
    strcpy(lib.rados_path, rados_path);
    strcpy(lib.rbd_path, rbd_path);
    rbd_libs[rbd_nlibs] = lib;
    found = &rbd_libs[rbd_nlibs++];
    pthread_mutex_unlock(&rbd_libs_lock);
    return found;
}

/* ------------------------------------------------------------------ the handle */

struct nq_rbd {
    struct nq_file f; /* first: what the queue holds (fd -1; released by rbd_release) */
    const struct rbd_lib *lib;
    rados_t cluster;
    rados_ioctx_t io;
    rbd_image_t image;
    uint32_t aio; /* librbd's calls out on it, every queue's (atomic) */
};

static void rbd_shut(struct nq_rbd *h)
{
    if (h->image)
        h->lib->rbd_close(h->image);
    if (h->io)
        h->lib->rados_ioctx_destroy(h->io);
    if (h->cluster)
        h->lib->rados_shutdown(h->cluster);
    free(h);
}

static void *rbd_closer(void *arg)
{
    struct nq_rbd *h = arg;
    struct timespec ms = {0, 1000000};
    while (__atomic_load_n(&h->aio, __ATOMIC_ACQUIRE))
        nanosleep(&ms, NULL);
    rbd_shut(h);
    return NULL;
}

/* The last reference let go (nq_file_put): closed now, or by a thread once librbd's calls are back. */
static void rbd_release(struct nq_file *f)
{
    struct nq_rbd *h = (struct nq_rbd *)f;
    if (!__atomic_load_n(&h->aio, __ATOMIC_ACQUIRE)) {
        rbd_shut(h);
        return;
    }
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, rbd_closer, h))
        fprintf(stderr, "csrc/be_rbd.c: no thread to close an image with librbd calls out: left open\n");
    pthread_attr_destroy(&attr);
}

int nq_rbd_open(const struct nq_rbd_params *p, struct nq_file **out, char *err, size_t errlen)
{
    const struct rbd_lib *lib = rbd_lib_load(p->librados, p->librbd, err, errlen);
    if (!lib)
        return -ENOENT;
    struct nq_rbd *h = calloc(1, sizeof *h);
    if (!h) {
        snprintf(err, errlen, "out of memory");
        return -ENOMEM;
    }
    h->lib = lib;
    h->f.fd = -1;
    h->f.refs = 1;
    h->f.depth = p->depth ? p->depth : 1;
    h->f.release = rbd_release;
    const char *what = "rados_create2";
    int rc = lib->rados_create2(&h->cluster, "ceph", p->name, 0);
    if (rc < 0) {
        h->cluster = NULL;
        goto fail;
    }
    what = "reading the conf file";
    if (p->conf && (rc = lib->rados_conf_read_file(h->cluster, p->conf)) < 0)
        goto fail;
    for (const char *const *o = p->options; o && o[0] && o[1]; o += 2) {
        what = o[0];
        if ((rc = lib->rados_conf_set(h->cluster, o[0], o[1])) < 0)
            goto fail;
    }
    what = "connecting to the cluster";
    if ((rc = lib->rados_connect(h->cluster)) < 0)
        goto fail;
    what = "opening the pool";
    if ((rc = lib->rados_ioctx_create(h->cluster, p->pool, &h->io)) < 0) {
        h->io = NULL;
        goto fail;
    }
    if (p->ns && p->ns[0])
        lib->rados_ioctx_set_namespace(h->io, p->ns);
    what = "opening the image";
    if ((rc = lib->rbd_open(h->io, p->image, &h->image, NULL)) < 0) {
        h->image = NULL;
        goto fail;
    }
    *out = &h->f;
    return 0;
fail:
    snprintf(err, errlen, "%s: %s", what, strerror(rc < 0 ? -rc : EIO));
    rbd_shut(h);
    return rc < 0 ? rc : -EIO;
}

uint64_t nq_rbd_size(struct nq_file *f)
{
    struct nq_rbd *h = (struct nq_rbd *)f;
    uint64_t size = 0;
    return h->lib->rbd_get_size(h->image, &size) < 0 ? 0 : size;
}

uint32_t nq_rbd_aio_outstanding(struct nq_file *f)
{
    return __atomic_load_n(&((struct nq_rbd *)f)->aio, __ATOMIC_RELAXED);
}

/* ------------------------------------------------------------------ one queue's completions */

struct rbd_q;

struct rbd_slot { /* the callback's argument: one per request slot */
    struct rbd_q *rq;
    struct nq_rbd *h;
    uint32_t idx;
};

struct rbd_q {
    pthread_mutex_t lock;
    int efd;              /* a dup of the queue's ring eventfd */
    uint32_t n;           /* the queue's request slots */
    uint32_t count;       /* finished, waiting for the poll (written under lock, read atomically) */
    uint32_t outstanding; /* calls out on librbd (atomic; decremented under lock) */
    uint32_t started;     /* since the last `submit` (the poll's thread only) */
    int orphaned;         /* the queue closed: callbacks count down and wake, nothing more */
    int queue_gone;       /* the queue was freed: the last callback frees this */
    uint32_t *done_idx, *take_idx;
    int32_t *done_res, *take_res;
    struct rbd_slot slots[];
};

const struct nq_backend_ops nq_backend_rbd;

static void rbd_q_free(struct rbd_q *rq)
{
    close(rq->efd);
    pthread_mutex_destroy(&rq->lock);
    free(rq);
}

static inline struct rbd_q *rbd_q_of(struct nq_queue *q)
{
    for (uint32_t i = 0; i < q->nstaged; i++)
        if (q->staged[i] == &nq_backend_rbd)
            return q->staged_state[i];
    return NULL;
}

/* Under rq->lock: (idx, res) for the poll; the eventfd written when the array was empty (the poll takes it whole,
 * so an entry added after a take always writes it). */
static inline void rbd_push_locked(struct rbd_q *rq, uint32_t idx, int32_t res)
{
    uint32_t n = rq->count;
    rq->done_idx[n] = idx;
    rq->done_res[n] = res;
    __atomic_store_n(&rq->count, n + 1, __ATOMIC_RELEASE);
    if (!n) {
        uint64_t one = 1;
        if (write(rq->efd, &one, sizeof one) < 0) { /* EAGAIN: the counter is full, so it is readable anyway */
        }
    }
}

/* librbd's completion thread (or the submitter's, if librbd completes in the call). */
static void rbd_cb(rbd_completion_t c, void *arg)
{
    struct rbd_slot *s = arg;
    struct rbd_q *rq = s->rq;
    struct nq_rbd *h = s->h;
    const struct rbd_lib *lib = h->lib;
    ssize_t res = lib->rbd_aio_get_return_value(c);
    lib->rbd_aio_release(c);
    int free_it = 0;
    pthread_mutex_lock(&rq->lock);
    uint32_t left = __atomic_sub_fetch(&rq->outstanding, 1, __ATOMIC_ACQ_REL);
    if (rq->queue_gone) {
        free_it = !left;
    } else if (rq->orphaned) {
        uint64_t one = 1; /* the owner's reap_closed counts what is left */
        if (write(rq->efd, &one, sizeof one) < 0) {
        }
    } else {
        rbd_push_locked(rq, s->idx, res < INT32_MIN ? -EIO : res > INT32_MAX ? INT32_MAX : (int32_t)res);
    }
    pthread_mutex_unlock(&rq->lock);
    if (free_it)
        rbd_q_free(rq);
    __atomic_sub_fetch(&h->aio, 1, __ATOMIC_RELEASE); /* last: the handle may be closed from here on */
}

static int rbd_attach(struct nq_queue *q, void **state)
{
    if (*state)
        return 0;
    if (!q->ring)
        return -EINVAL; /* the ring's eventfd and the bounce chunks come with enable_files */
    uint32_t n = q->nreqs;
    size_t size = sizeof(struct rbd_q) + n * sizeof(struct rbd_slot) + 2 * n * sizeof(uint32_t) +
                  2 * n * sizeof(int32_t);
    struct rbd_q *rq = calloc(1, size);
    if (!rq)
        return -ENOMEM;
    rq->efd = fcntl(nr_uring_eventfd(q->ring), F_DUPFD_CLOEXEC, 0);
    if (rq->efd < 0) {
        int err = errno;
        free(rq);
        return -err;
    }
    pthread_mutex_init(&rq->lock, NULL);
    rq->n = n;
    rq->done_idx = (uint32_t *)(rq->slots + n);
    rq->take_idx = rq->done_idx + n;
    rq->done_res = (int32_t *)(rq->take_idx + n);
    rq->take_res = rq->done_res + n;
    for (uint32_t i = 0; i < n; i++) {
        rq->slots[i].rq = rq;
        rq->slots[i].idx = i;
    }
    *state = rq;
    return 0;
}

static unsigned rbd_closed(struct nq_queue *q, void **state, int final)
{
    struct rbd_q *rq = *state;
    pthread_mutex_lock(&rq->lock);
    rq->orphaned = 1;
    __atomic_store_n(&rq->count, 0, __ATOMIC_RELAXED); /* finished, not reaped: the queue's requests go anyway */
    unsigned left = __atomic_load_n(&rq->outstanding, __ATOMIC_ACQUIRE);
    if (left && final)
        rq->queue_gone = 1; /* its last callback frees it */
    pthread_mutex_unlock(&rq->lock);
    if (!left)
        rbd_q_free(rq);
    if (!left || final)
        *state = NULL;
    return left;
}

enum rbd_op { RBD_READ, RBD_WRITE, RBD_FLUSH, RBD_ZEROES, RBD_DISCARD };

/* One command onto librbd (the poll's thread): NQ_BE_STARTED (a failed submission is a completion with its
 * error, reaped in this poll), or NQ_BE_WAIT when the namespace's depth is full and this queue has calls out. */
static int rbd_start(struct nq_queue *q, struct nq_req *r, uint32_t idx, enum rbd_op op)
{
    struct nq_file *f = r->file;
    struct nq_rbd *h = (struct nq_rbd *)f;
    struct rbd_q *rq = rbd_q_of(q);
    if (__atomic_load_n(&f->in_flight, __ATOMIC_RELAXED) >= f->depth &&
        __atomic_load_n(&rq->outstanding, __ATOMIC_RELAXED))
        return NQ_BE_WAIT;
    const struct rbd_lib *lib = h->lib;
    struct rbd_slot *s = &rq->slots[idx];
    s->h = h;
    rbd_completion_t c;
    int rc = lib->rbd_aio_create_completion(s, rbd_cb, &c);
    if (rc >= 0) {
        __atomic_add_fetch(&h->aio, 1, __ATOMIC_RELAXED);
        __atomic_add_fetch(&rq->outstanding, 1, __ATOMIC_RELAXED);
        switch (op) {
        case RBD_READ:
            rc = lib->rbd_aio_read(h->image, r->offset, r->len, r->local, c);
            break;
        case RBD_WRITE: /* FUA: nothing more, the cache is off */
            rc = lib->rbd_aio_write(h->image, r->offset, r->len, r->local, c);
            break;
        case RBD_FLUSH:
            rc = lib->rbd_aio_flush(h->image, c);
            break;
        case RBD_ZEROES:
            rc = lib->rbd_aio_write_zeroes ? lib->rbd_aio_write_zeroes(h->image, r->offset, r->op_len, c, 0, 0)
                                           : -EOPNOTSUPP; /* the core's: aio_write_zeroes through python3-rbd */
            break;
        case RBD_DISCARD: /* Write Zeroes with DEAC */
            rc = lib->rbd_aio_write_zeroes ? lib->rbd_aio_write_zeroes(h->image, r->offset, r->op_len, c, 0, 0)
                                           : lib->rbd_aio_discard(h->image, r->offset, r->op_len, c);
            break;
        }
        if (rc < 0) { /* not started: no callback will come */
            lib->rbd_aio_release(c);
            __atomic_sub_fetch(&rq->outstanding, 1, __ATOMIC_RELAXED);
            __atomic_sub_fetch(&h->aio, 1, __ATOMIC_RELAXED);
        }
    }
    if (rc < 0) {
        pthread_mutex_lock(&rq->lock);
        rbd_push_locked(rq, idx, rc);
        pthread_mutex_unlock(&rq->lock);
    }
    rq->started++;
    __atomic_fetch_add(&f->submitted, 1, __ATOMIC_RELAXED);
    uint32_t now = __atomic_add_fetch(&f->in_flight, 1, __ATOMIC_RELAXED);
    uint32_t most = __atomic_load_n(&f->most_in_flight, __ATOMIC_RELAXED);
    while (now > most && !__atomic_compare_exchange_n(&f->most_in_flight, &most, now, 1, __ATOMIC_RELAXED,
                                                       __ATOMIC_RELAXED))
        ;
    return NQ_BE_STARTED;
}

static int rbd_read(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    return rbd_start(q, r, idx, RBD_READ);
}

static int rbd_write(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    return rbd_start(q, r, idx, RBD_WRITE);
}

static int rbd_flush(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    return rbd_start(q, r, idx, RBD_FLUSH);
}

static int rbd_zeroes(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    return rbd_start(q, r, idx, RBD_ZEROES);
}

static int rbd_discard(struct nq_queue *q, struct nq_ns *ns, struct nq_req *r, uint32_t idx)
{
    return rbd_start(q, r, idx, RBD_DISCARD);
}

/* Every finished call, taken whole, each finished on the queue: the number. */
static int rbd_reap(struct nq_queue *q)
{
    struct rbd_q *rq = rbd_q_of(q);
    if (!rq || !__atomic_load_n(&rq->count, __ATOMIC_ACQUIRE))
        return 0;
    pthread_mutex_lock(&rq->lock);
    uint32_t n = rq->count;
    memcpy(rq->take_idx, rq->done_idx, n * sizeof *rq->take_idx);
    memcpy(rq->take_res, rq->done_res, n * sizeof *rq->take_res);
    __atomic_store_n(&rq->count, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&rq->lock);
    for (uint32_t i = 0; i < n && q->state < NQ_Q_CLOSED; i++) {
        uint32_t idx = rq->take_idx[i];
        int32_t res = rq->take_res[i];
        if (idx >= q->nreqs)
            continue;
        if (res == -ETIMEDOUT) /* the cluster did not answer within rados_osd_op_timeout */
            nq_backend_answer(q, idx, SC_ANA_TRANSITION);
        else if (res == -ESHUTDOWN) /* the cluster blocklisted (fenced) this client */
            nq_backend_answer(q, idx, SC_ANA_INACCESSIBLE);
        else /* librbd's value for a write, flush or zeroing is 0 (or the bytes): done is the command's length */
            nq_backend_done(q, idx, res >= 0 && q->reqs[idx].opc != OPC_READ ? (int)q->reqs[idx].len : res);
    }
    return (int)n;
}

/* The calls were made as the commands started: the number this poll started, so the poll reaps once more (a
 * call librbd completed at once, or refused). */
static int rbd_submit(struct nq_queue *q)
{
    struct rbd_q *rq = rbd_q_of(q);
    if (!rq)
        return 0;
    int n = (int)rq->started;
    rq->started = 0;
    return n;
}

static int rbd_fd(struct nq_queue *q)
{
    struct rbd_q *rq = rbd_q_of(q);
    return rq ? rq->efd : -1;
}

const struct nq_backend_ops nq_backend_rbd = {
    .name = "rbd",
    .flags = NQ_BE_STAGED | NQ_BE_NEEDS_FILE,
    .submit_read = rbd_read,
    .submit_write = rbd_write,
    .flush = rbd_flush,
    .write_zeroes = rbd_zeroes,
    .discard = rbd_discard,
    .reap = rbd_reap,
    .submit = rbd_submit,
    .fd = rbd_fd,
    .attach = rbd_attach,
    .closed = rbd_closed,
};
