/* A fake librados + librbd for the native RBD entry's tests (csrc/be_rbd.c loads it by path with dlopen in place of
 * Debian's librados.so.2 and librbd.so.1): the C calls the entry uses, on images in memory, with the windows the
 * tests open under their control (tests/unit/rbd_fake.py drives it through ctypes):
 *
 * - immediate (the default): an aio call moves its data and calls its callback inside the call;
 * - hold: every aio call is held (nothing moved) until fakerbd_release, which completes the oldest on a thread of
 *   its own, as librbd's completion thread, moving the data then: a Read's bytes land in the buffer the call was
 *   given only at completion time, so a use of a buffer let go, or the wrong one, shows;
 * - fakerbd_fail(err, n): the next n aio calls complete with err (-EIO, -ETIMEDOUT, -ESHUTDOWN), nothing moved;
 *   fakerbd_refuse(err, n): the next n are refused by the call itself.
 *
 * Completions come from a fixed pool (no malloc: the native path's allocation count stays ours).  rbd_close of an
 * image with calls still held aborts: the entry must never close one under its calls. */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>

typedef void (*rbd_callback_t)(void *c, void *arg);

enum { K_READ, K_WRITE, K_FLUSH, K_ZEROES, K_DISCARD, K_KINDS };

struct fimage {
    char name[64];
    char *data;
    uint64_t size;
    int opens;
    uint32_t held;
};

struct fcomp {
    rbd_callback_t cb;
    void *arg;
    ssize_t ret;
    int kind, err, used;
    struct fimage *img;
    uint64_t off, len;
    char *buf;
    struct fcomp *next;
};

#define FAKE_IMAGES 16
#define FAKE_COMPS 4096
#define FAKE_CONFS 32

static struct fimage images[FAKE_IMAGES];
static int nimages;
static struct fcomp comps[FAKE_COMPS];
static struct fcomp *free_comps, *held_head, *held_tail;
static int comps_ready;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int hold_mode, fail_err, fail_n, refuse_err, refuse_n, connect_err, connect_held;
static pthread_cond_t connect_cond = PTHREAD_COND_INITIALIZER;
static uint64_t calls[K_KINDS], completions, opens, closes, shutdowns, connects;
static char conf_keys[FAKE_CONFS][64], conf_vals[FAKE_CONFS][64];
static int nconfs;
static char last_name[64], last_pool[64], last_ns[64];
static uint32_t held_count;

static void comps_init(void)
{
    if (comps_ready)
        return;
    for (int i = FAKE_COMPS - 1; i >= 0; i--) {
        comps[i].next = free_comps;
        free_comps = &comps[i];
    }
    comps_ready = 1;
}

/* ---------------------------------------------------------------- the test's controls */

char *fakerbd_create(const char *name, uint64_t size)
{
    pthread_mutex_lock(&lock);
    struct fimage *img = NULL;
    for (int i = 0; i < nimages; i++)
        if (!strcmp(images[i].name, name))
            img = &images[i];
    if (!img && nimages < FAKE_IMAGES) {
        img = &images[nimages++];
        snprintf(img->name, sizeof img->name, "%s", name);
    }
    if (img && img->size != size) {
        free(img->data);
        img->data = calloc(1, size);
        img->size = size;
    } else if (img) {
        memset(img->data, 0, size);
    }
    pthread_mutex_unlock(&lock);
    return img ? img->data : NULL;
}

void fakerbd_reset(void)
{
    pthread_mutex_lock(&lock);
    hold_mode = fail_err = fail_n = refuse_err = refuse_n = connect_err = connect_held = 0;
    memset(calls, 0, sizeof calls);
    completions = opens = closes = shutdowns = connects = 0;
    nconfs = 0;
    pthread_mutex_unlock(&lock);
}

void fakerbd_hold(int on) { pthread_mutex_lock(&lock); hold_mode = on; pthread_mutex_unlock(&lock); }
void fakerbd_fail(int err, int n) { pthread_mutex_lock(&lock); fail_err = err; fail_n = n; pthread_mutex_unlock(&lock); }
void fakerbd_refuse(int err, int n) { pthread_mutex_lock(&lock); refuse_err = err; refuse_n = n; pthread_mutex_unlock(&lock); }
void fakerbd_connect_error(int err) { pthread_mutex_lock(&lock); connect_err = err; pthread_mutex_unlock(&lock); }

/* 1: rados_connect waits (a cluster slow to answer) until fakerbd_hold_connect(0). */
void fakerbd_hold_connect(int on)
{
    pthread_mutex_lock(&lock);
    connect_held = on;
    pthread_cond_broadcast(&connect_cond);
    pthread_mutex_unlock(&lock);
}

uint32_t fakerbd_held(void)
{
    pthread_mutex_lock(&lock);
    uint32_t n = held_count;
    pthread_mutex_unlock(&lock);
    return n;
}

/* "read", "write", "flush", "zeroes", "discard", "completions", "opens", "closes", "shutdowns", "connects",
 * "open_images" (rbd_open minus rbd_close) */
uint64_t fakerbd_counter(const char *what)
{
    static const char *kinds[K_KINDS] = {"read", "write", "flush", "zeroes", "discard"};
    uint64_t v = UINT64_MAX;
    pthread_mutex_lock(&lock);
    for (int k = 0; k < K_KINDS; k++)
        if (!strcmp(what, kinds[k]))
            v = calls[k];
    if (!strcmp(what, "completions")) v = completions;
    if (!strcmp(what, "opens")) v = opens;
    if (!strcmp(what, "closes")) v = closes;
    if (!strcmp(what, "shutdowns")) v = shutdowns;
    if (!strcmp(what, "connects")) v = connects;
    if (!strcmp(what, "open_images")) v = opens - closes;
    pthread_mutex_unlock(&lock);
    return v;
}

/* What rados_conf_set last set `key` to, "" if never; "name", "pool", "namespace": the last client's. */
const char *fakerbd_conf(const char *key)
{
    if (!strcmp(key, "name")) return last_name;
    if (!strcmp(key, "pool")) return last_pool;
    if (!strcmp(key, "namespace")) return last_ns;
    for (int i = nconfs - 1; i >= 0; i--)
        if (!strcmp(conf_keys[i], key))
            return conf_vals[i];
    return "";
}

/* ---------------------------------------------------------------- completing */

static void complete(struct fcomp *c)
{
    struct fimage *img = c->img;
    if (c->err) {
        c->ret = c->err;
    } else {
        switch (c->kind) {
        case K_READ:
            memcpy(c->buf, img->data + c->off, c->len);
            c->ret = (ssize_t)c->len;
            break;
        case K_WRITE:
            memcpy(img->data + c->off, c->buf, c->len);
            c->ret = (ssize_t)c->len;
            break;
        case K_ZEROES:
        case K_DISCARD:
            memset(img->data + c->off, 0, c->len);
            c->ret = 0;
            break;
        default:
            c->ret = 0;
        }
    }
    pthread_mutex_lock(&lock);
    completions++;
    pthread_mutex_unlock(&lock);
    c->cb(c, c->arg);
}

struct release_job {
    uint32_t n;
    int err;
};

static void *release_thread(void *arg)
{
    struct release_job *job = arg;
    for (uint32_t i = 0; i < job->n; i++) {
        pthread_mutex_lock(&lock);
        struct fcomp *c = held_head;
        if (c) {
            held_head = c->next;
            if (!held_head)
                held_tail = NULL;
            held_count--;
            c->img->held--;
            if (job->err)
                c->err = job->err;
        }
        pthread_mutex_unlock(&lock);
        if (!c)
            break;
        complete(c);
    }
    return NULL;
}

/* Complete the oldest `n` held calls (err: with that error instead), on a thread of their own; returns once their
 * callbacks returned, with the number still held. */
uint32_t fakerbd_release(uint32_t n, int err)
{
    struct release_job job = {n, err};
    pthread_t t;
    if (pthread_create(&t, NULL, release_thread, &job))
        abort();
    pthread_join(t, NULL);
    return fakerbd_held();
}

/* ---------------------------------------------------------------- librados */

int rados_create2(void **cluster, const char *clustername, const char *name, uint64_t flags)
{
    pthread_mutex_lock(&lock);
    snprintf(last_name, sizeof last_name, "%s", name ? name : "");
    pthread_mutex_unlock(&lock);
    *cluster = (void *)0x1;
    return 0;
}

int rados_conf_read_file(void *cluster, const char *path) { return 0; }

int rados_conf_set(void *cluster, const char *key, const char *value)
{
    pthread_mutex_lock(&lock);
    if (nconfs < FAKE_CONFS) {
        snprintf(conf_keys[nconfs], 64, "%s", key);
        snprintf(conf_vals[nconfs], 64, "%s", value);
        nconfs++;
    }
    pthread_mutex_unlock(&lock);
    return 0;
}

int rados_connect(void *cluster)
{
    pthread_mutex_lock(&lock);
    while (connect_held)
        pthread_cond_wait(&connect_cond, &lock);
    int err = connect_err;
    connects++;
    pthread_mutex_unlock(&lock);
    return err;
}

void rados_shutdown(void *cluster)
{
    pthread_mutex_lock(&lock);
    shutdowns++;
    pthread_mutex_unlock(&lock);
}

int rados_ioctx_create(void *cluster, const char *pool, void **io)
{
    pthread_mutex_lock(&lock);
    snprintf(last_pool, sizeof last_pool, "%s", pool);
    last_ns[0] = 0;
    pthread_mutex_unlock(&lock);
    *io = (void *)0x2;
    return 0;
}

void rados_ioctx_destroy(void *io) {}

void rados_ioctx_set_namespace(void *io, const char *ns)
{
    pthread_mutex_lock(&lock);
    snprintf(last_ns, sizeof last_ns, "%s", ns ? ns : "");
    pthread_mutex_unlock(&lock);
}

/* ---------------------------------------------------------------- librbd */

int rbd_open(void *io, const char *name, void **image, const char *snap)
{
    pthread_mutex_lock(&lock);
    struct fimage *img = NULL;
    for (int i = 0; i < nimages; i++)
        if (!strcmp(images[i].name, name))
            img = &images[i];
    if (img) {
        img->opens++;
        opens++;
    }
    pthread_mutex_unlock(&lock);
    if (!img)
        return -ENOENT;
    *image = img;
    return 0;
}

int rbd_close(void *image)
{
    struct fimage *img = image;
    pthread_mutex_lock(&lock);
    if (img->held) {
        fprintf(stderr, "fakerbd: rbd_close of %s with %u calls still held\n", img->name, img->held);
        abort();
    }
    img->opens--;
    closes++;
    pthread_mutex_unlock(&lock);
    return 0;
}

int rbd_get_size(void *image, uint64_t *size)
{
    *size = ((struct fimage *)image)->size;
    return 0;
}

int rbd_aio_create_completion(void *arg, rbd_callback_t cb, void **c)
{
    pthread_mutex_lock(&lock);
    comps_init();
    struct fcomp *f = free_comps;
    if (!f) {
        fprintf(stderr, "fakerbd: out of completions\n");
        abort();
    }
    free_comps = f->next;
    pthread_mutex_unlock(&lock);
    memset(f, 0, sizeof *f);
    f->cb = cb;
    f->arg = arg;
    f->used = 1;
    *c = f;
    return 0;
}

ssize_t rbd_aio_get_return_value(void *c) { return ((struct fcomp *)c)->ret; }

void rbd_aio_release(void *c)
{
    struct fcomp *f = c;
    pthread_mutex_lock(&lock);
    if (!f->used)
        abort(); /* released twice */
    f->used = 0;
    f->next = free_comps;
    free_comps = f;
    pthread_mutex_unlock(&lock);
}

static int submit(void *image, int kind, uint64_t off, uint64_t len, char *buf, void *c)
{
    struct fimage *img = image;
    struct fcomp *f = c;
    pthread_mutex_lock(&lock);
    calls[kind]++;
    if (refuse_n) {
        refuse_n--;
        pthread_mutex_unlock(&lock);
        return refuse_err;
    }
    if (off > img->size || len > img->size - off) {
        pthread_mutex_unlock(&lock);
        return -EINVAL;
    }
    f->kind = kind;
    f->img = img;
    f->off = off;
    f->len = len;
    f->buf = buf;
    if (fail_n) {
        fail_n--;
        f->err = fail_err;
    }
    if (hold_mode) {
        f->next = NULL;
        if (held_tail)
            held_tail->next = f;
        else
            held_head = f;
        held_tail = f;
        held_count++;
        img->held++;
        pthread_mutex_unlock(&lock);
        return 0;
    }
    pthread_mutex_unlock(&lock);
    complete(f);
    return 0;
}

int rbd_aio_read(void *image, uint64_t off, size_t len, char *buf, void *c)
{
    return submit(image, K_READ, off, len, buf, c);
}

int rbd_aio_write(void *image, uint64_t off, size_t len, const char *buf, void *c)
{
    return submit(image, K_WRITE, off, len, (char *)buf, c);
}

int rbd_aio_flush(void *image, void *c) { return submit(image, K_FLUSH, 0, 0, NULL, c); }

int rbd_aio_discard(void *image, uint64_t off, uint64_t len, void *c)
{
    return submit(image, K_DISCARD, off, len, NULL, c);
}

int rbd_aio_write_zeroes(void *image, uint64_t off, size_t len, void *c, int zero_flags, int op_flags)
{
    return submit(image, K_ZEROES, off, len, NULL, c);
}
