/* Poll groups: `target serve --cores N` runs N of these threads, each polling its native queues without the GIL
 * (docs/native.md, "Poll groups"), like SPDK's poll groups.
 *
 * Safety: a queue belongs to one group.  The thread holds the group's mutex for a pass over its queues and each
 * queue's own mutex while it polls and posts on it; every Python-side call on the queue (post_read,
 * post_response, set_view, take_stats, drain, close) holds the same queue mutex, taken with the GIL released
 * when it has to wait.  The thread never takes the GIL: whatever needs Python (a capsule for the core, a send
 * completion of the Python side, a failure) goes on the queue's mailbox (csrc/mailbox.c), which the
 * event loop drains.  `remove` stops the queue under its mutex (nothing of it is polled after that) before the
 * caller destroys its QP.  Lock order: group, then queue; the Python side never holds both.
 */
#include "native.h"
#include "nq_threaded.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define PG_IDLE_PASSES 64 /* empty passes before the thread yields the CPU on each further empty pass */

/* ------------------------------------------------------------------ the group */

typedef struct {
    PyObject_HEAD
    pthread_t thread;
    int started;
    int stop;              /* __atomic: the thread ends its loop */
    int budget;            /* completions per queue per pass */
    pthread_mutex_t lock;  /* the queues array */
    void **queues;         /* _native.Queue objects, one reference each */
    int count, cap;
    uint64_t passes, busy_passes; /* __atomic */
} PollGroup;

static void *pg_main(void *arg)
{
    PollGroup *g = arg;
    unsigned idle = 0;
    while (!__atomic_load_n(&g->stop, __ATOMIC_ACQUIRE)) {
        int work = 0;
        pthread_mutex_lock(&g->lock);
        for (int i = 0; i < g->count; i++)
            work += native_queue_poll_threaded(g->queues[i], g->budget);
        pthread_mutex_unlock(&g->lock);
        __atomic_add_fetch(&g->passes, 1, __ATOMIC_RELAXED);
        if (work) {
            __atomic_add_fetch(&g->busy_passes, 1, __ATOMIC_RELAXED);
            idle = 0;
        } else if (++idle >= PG_IDLE_PASSES) {
            sched_yield(); /* still polling, but another runnable thread of this CPU gets it first */
        }
    }
    return NULL;
}

static void pg_lock(PollGroup *g)
{
    if (pthread_mutex_trylock(&g->lock) == 0)
        return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&g->lock);
    Py_END_ALLOW_THREADS
}

static int PollGroup_init(PollGroup *g, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"budget", NULL};
    int budget = 64;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|i", kwlist, &budget))
        return -1;
    if (g->started) {
        PyErr_SetString(PyExc_RuntimeError, "a poll group is initialised once");
        return -1;
    }
    if (budget < 1) {
        PyErr_SetString(PyExc_ValueError, "budget must be at least 1");
        return -1;
    }
    g->budget = budget;
    pthread_mutex_init(&g->lock, NULL);
    int rc = pthread_create(&g->thread, NULL, pg_main, g);
    if (rc) {
        pthread_mutex_destroy(&g->lock);
        errno = rc;
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    g->started = 1;
    return 0;
}

static void pg_join(PollGroup *g)
{
    if (g->started != 1)
        return;
    __atomic_store_n(&g->stop, 1, __ATOMIC_RELEASE);
    Py_BEGIN_ALLOW_THREADS
    pthread_join(g->thread, NULL);
    Py_END_ALLOW_THREADS
    g->started = 2;
}

/* add(queue) -> the queue's mailbox eventfd: from now on this group's thread polls the queue. */
static PyObject *PollGroup_add(PollGroup *g, PyObject *queue)
{
    if (!native_queue_check(queue)) {
        PyErr_SetString(PyExc_TypeError, "add() takes a _native.Queue");
        return NULL;
    }
    if (g->started != 1) {
        PyErr_SetString(PyExc_RuntimeError, "the poll group is closed");
        return NULL;
    }
    int fd = native_queue_attach(queue);
    if (fd < 0)
        return NULL;
    pg_lock(g);
    if (g->count == g->cap) {
        int cap = g->cap ? 2 * g->cap : 8;
        void **grown = realloc(g->queues, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&g->lock);
            native_queue_stop(queue);
            return PyErr_NoMemory();
        }
        g->queues = grown;
        g->cap = cap;
    }
    Py_INCREF(queue);
    g->queues[g->count++] = queue;
    pthread_mutex_unlock(&g->lock);
    return PyLong_FromLong(fd);
}

/* remove(queue): stopped (nothing of it is polled or posted after this returns), then out of the group. */
static PyObject *PollGroup_remove(PollGroup *g, PyObject *queue)
{
    native_queue_stop(queue);
    pg_lock(g);
    int found = 0;
    for (int i = 0; i < g->count; i++)
        if (g->queues[i] == queue) {
            memmove(&g->queues[i], &g->queues[i + 1], (g->count - i - 1) * sizeof *g->queues);
            g->count--;
            found = 1;
            break;
        }
    pthread_mutex_unlock(&g->lock);
    if (found)
        Py_DECREF(queue);
    return PyBool_FromLong(found);
}

static void pg_release_all(PollGroup *g)
{
    /* the thread has ended: no lock needed */
    for (int i = 0; i < g->count; i++) {
        native_queue_stop(g->queues[i]);
        Py_DECREF((PyObject *)g->queues[i]);
    }
    g->count = 0;
}

static PyObject *PollGroup_close(PollGroup *g, PyObject *noargs)
{
    pg_join(g);
    pg_release_all(g);
    Py_RETURN_NONE;
}

static PyObject *PollGroup_stats(PollGroup *g, PyObject *noargs)
{
    int count;
    if (g->started == 1) {
        pg_lock(g);
        count = g->count;
        pthread_mutex_unlock(&g->lock);
    } else {
        count = g->count;
    }
    return Py_BuildValue("{sisKsKsO}", "queues", count, "passes",
                         (unsigned long long)__atomic_load_n(&g->passes, __ATOMIC_RELAXED), "busy_passes",
                         (unsigned long long)__atomic_load_n(&g->busy_passes, __ATOMIC_RELAXED), "running",
                         g->started == 1 ? Py_True : Py_False);
}

static void PollGroup_dealloc(PollGroup *g)
{
    pg_join(g);
    pg_release_all(g);
    free(g->queues);
    if (g->started)
        pthread_mutex_destroy(&g->lock);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

static PyMethodDef PollGroup_methods[] = {
    {"add", (PyCFunction)PollGroup_add, METH_O, "add(queue) -> the queue's mailbox eventfd; polled from now on."},
    {"remove", (PyCFunction)PollGroup_remove, METH_O,
     "remove(queue): stop polling it (before its QP is destroyed); True if it was in this group."},
    {"close", (PyCFunction)PollGroup_close, METH_NOARGS, "Stop the thread (joined) and let every queue go."},
    {"stats", (PyCFunction)PollGroup_stats, METH_NOARGS, "{queues, passes, busy_passes, running}."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject PollGroupType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "nvmeof_roce._native.PollGroup",
    .tp_basicsize = sizeof(PollGroup),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A thread polling native queues without the GIL (docs/native.md, \"Poll groups\").",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)PollGroup_init,
    .tp_dealloc = (destructor)PollGroup_dealloc,
    .tp_methods = PollGroup_methods,
};

int native_pollgroup_register(PyObject *module)
{
    if (PyType_Ready(&PollGroupType) < 0)
        return -1;
    Py_INCREF(&PollGroupType);
    if (PyModule_AddObject(module, "PollGroup", (PyObject *)&PollGroupType) < 0) {
        Py_DECREF(&PollGroupType);
        return -1;
    }
    return 0;
}
