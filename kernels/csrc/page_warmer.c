/* The KV page warmer's thread (kernels/cpu_prefault.py, shared/engine/page_warmer.py): keeps the KV blocks
 * an engine hands out next resident, ahead of need, on CPU time nothing else wants, without ever taking
 * Python's GIL or the process's mmap lock.
 *
 * The window: blocks [0, warmed) of every region are resident, [0, wanted) should be. `wanted` only grows
 * (moorage_warmer_want). The thread faults [warmed, min(wanted, warmed + step)) in, and sleeps on a
 * condition when there is nothing to do. It faults each 4 KiB page in by an atomic add of 0 to its first
 * word: a write fault, so the page is resident and writable, and no byte changes, even against a
 * concurrent writer (a locked read-modify-write; GCC emits `lock add`).
 *
 * Why touch, not madvise(MADV_POPULATE_WRITE), and why nice 19 is safe now: madvise holds the process's
 * mmap lock for its whole range, and any mmap or munmap elsewhere in the process then waits, and every page
 * fault after that waits behind the writer. A nice-19 thread on a host busy with other work is left off
 * the CPU while it holds the lock, so the whole engine stalled: 8 first turns on `moorage up` with two
 * spinning processes beside it on 2 cores took 111-115 s (the Python thread this replaces, and this
 * thread with madvise), 38 s with madvise at nice 0, 32 s with no warmer. A page fault takes only the
 * region's own lock (per-VMA locks, Linux >= 6.4), which nothing else in the process needs, and a
 * thread at nice 19 then costs the engine nothing: the same runs took 67 s in all, as with no warmer.
 *
 * Lifetime: the caller keeps the regions' memory alive until moorage_warmer_stop returns (it joins).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work;      /* wanted moved, or stop asked */
    pthread_cond_t progress;  /* warmed moved, or the thread ended */
    pthread_t thread;
    int n;
    uint64_t *base;
    int64_t *block_bytes;
    int64_t num_blocks, step_blocks, piece_bytes;
    int64_t warmed, wanted;
    int stop, ended;
} warmer_t;

/* Faults blocks [lo, hi) of every region in; checks for stop every piece. */
static void populate(warmer_t *w, int64_t lo, int64_t hi) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    for (int r = 0; r < w->n; r++) {
        uintptr_t a = (uintptr_t)(w->base[r] + (uint64_t)(lo * w->block_bytes[r]));
        uintptr_t z = (uintptr_t)(w->base[r] + (uint64_t)(hi * w->block_bytes[r]));
        a -= a % page; /* every page holding a byte of the range: adding 0 changes no byte, ours or not */
        for (uintptr_t s = a; s < z; s += (uintptr_t)w->piece_bytes) {
            if (__atomic_load_n(&w->stop, __ATOMIC_RELAXED))
                return;
            uintptr_t e = s + (uintptr_t)w->piece_bytes < z ? s + (uintptr_t)w->piece_bytes : z;
            for (uintptr_t q = s; q < e; q += page)
                __atomic_fetch_add((volatile uint64_t *)q, 0, __ATOMIC_RELAXED);
        }
    }
}

static void *run(void *arg) {
    warmer_t *w = arg;
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), 19); /* this thread only (Linux): idle CPU only */
    pthread_mutex_lock(&w->mu);
    while (!w->stop && w->warmed < w->num_blocks) {
        if (w->warmed >= w->wanted) {
            pthread_cond_wait(&w->work, &w->mu);
            continue;
        }
        int64_t lo = w->warmed, hi = w->wanted < lo + w->step_blocks ? w->wanted : lo + w->step_blocks;
        pthread_mutex_unlock(&w->mu);
        populate(w, lo, hi);
        pthread_mutex_lock(&w->mu);
        if (!w->stop)
            w->warmed = hi;
        pthread_cond_broadcast(&w->progress);
    }
    w->ended = 1;
    pthread_cond_broadcast(&w->progress);
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* Starts the thread over n regions (base address and bytes per block of each), warming [0, wanted) at
 * once; piece_bytes: how often it looks for a stop. 0 and *out set, or an errno. */
int moorage_warmer_start(int n, const uint64_t *base, const int64_t *block_bytes, int64_t num_blocks,
                         int64_t step_blocks, int64_t piece_bytes, int64_t wanted, void **out) {
    if (n <= 0 || num_blocks <= 0 || step_blocks <= 0 || piece_bytes <= 0 || wanted < 0)
        return EINVAL;
    warmer_t *w = calloc(1, sizeof *w);
    if (!w)
        return ENOMEM;
    w->base = malloc((size_t)n * sizeof *w->base);
    w->block_bytes = malloc((size_t)n * sizeof *w->block_bytes);
    if (!w->base || !w->block_bytes) {
        free(w->base);
        free(w->block_bytes);
        free(w);
        return ENOMEM;
    }
    memcpy(w->base, base, (size_t)n * sizeof *w->base);
    memcpy(w->block_bytes, block_bytes, (size_t)n * sizeof *w->block_bytes);
    w->n = n;
    w->num_blocks = num_blocks;
    w->step_blocks = step_blocks;
    w->piece_bytes = piece_bytes;
    w->wanted = wanted < num_blocks ? wanted : num_blocks;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->work, NULL);
    pthread_cond_init(&w->progress, NULL);
    int rc = pthread_create(&w->thread, NULL, run, w);
    if (rc != 0) {
        free(w->base);
        free(w->block_bytes);
        free(w);
        return rc;
    }
    pthread_setname_np(w->thread, "kv-page-warmer"); /* top -H, /proc/PID/task/TID/comm (15 chars at most) */
    *out = w;
    return 0;
}

/* Raises the window's end to `wanted` (never lowers it). */
int moorage_warmer_want(void *handle, int64_t wanted) {
    warmer_t *w = handle;
    pthread_mutex_lock(&w->mu);
    if (wanted > w->num_blocks)
        wanted = w->num_blocks;
    if (wanted > w->wanted) {
        w->wanted = wanted;
        pthread_cond_signal(&w->work);
    }
    pthread_mutex_unlock(&w->mu);
    return 0;
}

/* out[0] warmed, out[1] wanted, out[2] ended (the thread returned). */
int moorage_warmer_state(void *handle, int64_t *out) {
    warmer_t *w = handle;
    pthread_mutex_lock(&w->mu);
    out[0] = w->warmed;
    out[1] = w->wanted;
    out[2] = w->ended;
    pthread_mutex_unlock(&w->mu);
    return 0;
}

/* Waits until everything wanted so far is resident or the thread ended: 1, or 0 after timeout_ms. */
int moorage_warmer_wait(void *handle, int64_t timeout_ms) {
    warmer_t *w = handle;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec += 1;
        until.tv_nsec -= 1000000000L;
    }
    int rc = 0;
    pthread_mutex_lock(&w->mu);
    while (!w->ended && w->warmed < w->wanted && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&w->progress, &w->mu, &until);
    int idle = w->ended || w->warmed >= w->wanted;
    pthread_mutex_unlock(&w->mu);
    return idle;
}

/* Stops the thread (it ends within one piece), joins it and frees the warmer. */
int moorage_warmer_stop(void *handle) {
    warmer_t *w = handle;
    pthread_mutex_lock(&w->mu);
    __atomic_store_n(&w->stop, 1, __ATOMIC_RELAXED);
    pthread_cond_signal(&w->work);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->thread, NULL);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->work);
    pthread_cond_destroy(&w->progress);
    free(w->base);
    free(w->block_bytes);
    free(w);
    return 0;
}
