/* The mailbox of a poll group's queue (csrc/mailbox.h): plain C, no Python.  The poll thread fills it, the event
 * loop drains it; csrc/nq_hot.c and nq_type.c use it, csrc/pollgroup.c does not (it only polls queues). */
#include "mailbox.h"

#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

int nq_mailbox_init(struct nq_mailbox *m, uint32_t size)
{
    memset(m, 0, sizeof *m);
    m->fd = -1;
    m->ring = calloc(size, sizeof *m->ring);
    if (!m->ring)
        return -1;
    m->fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (m->fd < 0) {
        free(m->ring);
        m->ring = NULL;
        return -1;
    }
    m->size = size;
    return 0;
}

void nq_mailbox_free(struct nq_mailbox *m)
{
    free(m->ring);
    m->ring = NULL;
    if (m->fd >= 0)
        close(m->fd);
    m->fd = -1;
}

int nq_mailbox_push(struct nq_mailbox *m, uint32_t kind, uint32_t a, uint64_t b)
{
    /* the last entry is kept for a failure, which must always get through */
    if (m->count >= m->size || (kind != NQ_MAIL_FAILURE && m->count + 1 >= m->size))
        return -1;
    struct nq_mail *e = &m->ring[(m->head + m->count++) % m->size];
    e->kind = kind;
    e->a = a;
    e->b = b;
    return 0;
}

void nq_mailbox_wake(struct nq_mailbox *m)
{
    if (!m->count || m->signaled)
        return;
    uint64_t one = 1;
    if (write(m->fd, &one, sizeof one) == sizeof one)
        m->signaled = 1;
}

void nq_mailbox_clear_wake(struct nq_mailbox *m)
{
    uint64_t value;
    while (read(m->fd, &value, sizeof value) == sizeof value)
        ;
    m->signaled = 0;
}
