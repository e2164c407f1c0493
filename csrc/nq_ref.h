/* A namespace's reference (engine/subsystem.py "references", docs/native.md "References and fencing"): the commands in flight on
 * one epoch of a namespace, which a change waits for.  The hot path (csrc/nq_hot.c) takes one when it parses a
 * command it serves and lets it go when the command's slot is freed (its last work request completed or flushed).
 * `_native.Ref` (csrc/nq_ref.c) is its Python face; a view (csrc/nq_view.c) holds it while it lists it. */
#ifndef NQ_REF_H
#define NQ_REF_H

#include <stdint.h>
#include <stdlib.h>

/* One word, so a command changes it with one atomic operation: the low 32 bits count the commands holding it, the
 * high 32 bits its other holders (the Python object, the views that list it).  Freed when the word reaches 0. */
struct nq_ref {
    uint64_t word;
};

#define NQ_REF_HOLDER (1ULL << 32)

/* A command takes it (it holds the namespace until its slot is freed). */
static inline void nq_ref_take(struct nq_ref *r)
{
    __atomic_fetch_add(&r->word, 1, __ATOMIC_RELAXED);
}

/* Release: what the command did to the namespace's memory happens before a change that sees the count drop. */
static inline void nq_ref_drop(struct nq_ref *r, uint64_t n)
{
    if (__atomic_sub_fetch(&r->word, n, __ATOMIC_ACQ_REL) == 0)
        free(r);
}

static inline void nq_ref_put(struct nq_ref *r)
{
    nq_ref_drop(r, 1);
}

static inline void nq_ref_hold(struct nq_ref *r)
{
    __atomic_fetch_add(&r->word, NQ_REF_HOLDER, __ATOMIC_RELAXED);
}

static inline void nq_ref_unhold(struct nq_ref *r)
{
    nq_ref_drop(r, NQ_REF_HOLDER);
}

static inline uint32_t nq_ref_commands(const struct nq_ref *r)
{
    return (uint32_t)__atomic_load_n(&r->word, __ATOMIC_ACQUIRE);
}

#endif
