/* LD_PRELOAD: counts calls to malloc, calloc and realloc (nvmeof_roce/bench/cost/native.py reads malloc_count_calls
 * through ctypes around the polls it measures; run Python with PYTHONMALLOC=malloc so its objects count too). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

unsigned long long malloc_count_calls;

void *__libc_malloc(size_t);
void *__libc_calloc(size_t, size_t);
void *__libc_realloc(void *, size_t);

void *malloc(size_t n) { malloc_count_calls++; return __libc_malloc(n); }
void *calloc(size_t a, size_t b) { malloc_count_calls++; return __libc_calloc(a, b); }
void *realloc(void *p, size_t n) { malloc_count_calls++; return __libc_realloc(p, n); }
