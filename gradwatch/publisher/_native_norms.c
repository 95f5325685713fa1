/* A thread that takes the gradients' sums of squares while backward goes on, and never needs the GIL.
 *
 * Why (docs/design.md, "Gradient norms during backward"; bench/README.md 1.18): grad_prefetch.py's worker
 * measured each gradient with torch on a Python thread, which needs the GIL twice per gradient (to come
 * back from the kernel, to take the next one). From the end of backward the training thread holds the GIL
 * through the boundary, so the last gradients waited for it: on the 8x1024 MLP the first layer's bias (1,024
 * values) took 180 us and its 4 MB weight started 230 us late, and the boundary waited for both. This thread
 * touches no Python object: the hook hands it a gradient's data pointer together with a reference to the
 * tensor (its memory stays until the reference is dropped, by the training thread, after the job); it writes
 * the float64 sum of squares into the parameter's slot and the post's number beside it. The boundary waits
 * for the queue to drain with the GIL released and takes the sums.
 *
 * norms_open(sizes: tuple[int, ...]) -> capsule: one worker for parameters of these sizes (started lazily).
 * norms_post(cap, grad, slot) -> bool: False when the pass cannot read it (not an exact contiguous float32 CPU
 *     tensor of sizes[slot] values), the queue is full, the worker cannot start, or this is a forked child:
 *     then the caller measures that gradient another way. First drops the references of finished jobs: a
 *     gradient is held at most until the next post or take (one backward's gradients at most).
 * norms_take(cap, timeout_s) -> list[float | None] | None: waits until every post is done, then per slot the
 *     sum of squares of its last post since the last take (None: none); None when the worker did not finish
 *     in time or this is a forked child. Drops the references of the finished posts.
 * norms_close(cap): stop and join the worker, drop every reference (also when the capsule goes).
 */
#include "_native.h"
#ifdef GW_NORM_WORKER
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define CAPSULE "gradwatch.norms"

typedef struct {
    PyObject *t; /* the tensor: a strong reference, dropped by the training thread once the job is done */
    const float *p;
    Py_ssize_t n, slot;
    uint64_t seq;
} job_t;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, idle;
    pthread_t th;
    int started, stop;
    pid_t pid;
    Py_ssize_t nslots;
    Py_ssize_t *sizes;
    double *sums, *snap;
    uint64_t *posted, *done; /* per slot: the last post's number since the last take (0: none); the last done */
    char *ok;
    job_t *q;
    size_t cap, rel, head, tail; /* rel <= head <= tail: references dropped, jobs done, jobs posted */
    uint64_t seq;
} normw_t;

static void *run(void *arg) {
    normw_t *w = (normw_t *)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals go to Python's threads, never here */
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->head == w->tail && !w->stop) pthread_cond_wait(&w->work, &w->mu);
        if (w->stop) break;
        job_t j = w->q[w->head % w->cap];
        pthread_mutex_unlock(&w->mu);
        double s = gw_sumsq(j.p, j.n);
        pthread_mutex_lock(&w->mu);
        w->sums[j.slot] = s;
        w->done[j.slot] = j.seq;
        w->head++;
        if (w->head == w->tail) pthread_cond_broadcast(&w->idle);
    }
    pthread_cond_broadcast(&w->idle);
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

/* Under the lock: up to `max` references of finished jobs, moved into `into` (the caller drops them after
 * unlocking, with the GIL: a tensor's deallocation may run Python code, which may post again). */
static size_t collect_drops(normw_t *w, size_t upto, PyObject **into, size_t max) {
    size_t nd = 0;
    while (w->rel < upto && nd < max) into[nd++] = w->q[w->rel++ % w->cap].t;
    return nd;
}

static void drop_refs(PyObject **refs, size_t n) {
    for (size_t i = 0; i < n; i++) Py_DECREF(refs[i]);
}

static void stop_join(normw_t *w) {
    if (!w->started) return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_broadcast(&w->work);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->th, NULL); /* the worker needs no GIL: joining with it held cannot deadlock */
    w->started = 0;
}

static void drop_all(normw_t *w) { /* (the worker is stopped: nothing else reads the queue) */
    w->head = w->tail;
    PyObject *refs[64];
    size_t nd;
    while ((nd = collect_drops(w, w->tail, refs, 64)) > 0) drop_refs(refs, nd);
}

static void destroy(PyObject *cap) {
    normw_t *w = (normw_t *)PyCapsule_GetPointer(cap, CAPSULE);
    if (!w) {
        PyErr_Clear();
        return;
    }
    if (w->pid != getpid()) return; /* a forked child: the lock may be held by a thread it does not have */
    stop_join(w);
    drop_all(w);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->work);
    pthread_cond_destroy(&w->idle);
    free(w->sizes), free(w->sums), free(w->snap), free(w->posted), free(w->done), free(w->ok), free(w->q);
    free(w);
}

PyObject *gw_norms_open(PyObject *self, PyObject *sizes) {
    (void)self;
    if (!PyTuple_CheckExact(sizes)) {
        PyErr_SetString(PyExc_TypeError, "norms_open(sizes: tuple[int, ...])");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(sizes);
    normw_t *w = (normw_t *)calloc(1, sizeof(normw_t));
    if (!w) return PyErr_NoMemory();
    w->nslots = n;
    w->cap = (size_t)(4 * n + 64); /* micro-batches post a gradient again; a full queue only means "measure it" */
    w->sizes = (Py_ssize_t *)calloc(n ? n : 1, sizeof(Py_ssize_t));
    w->sums = (double *)calloc(n ? n : 1, sizeof(double));
    w->snap = (double *)calloc(n ? n : 1, sizeof(double));
    w->posted = (uint64_t *)calloc(n ? n : 1, sizeof(uint64_t));
    w->done = (uint64_t *)calloc(n ? n : 1, sizeof(uint64_t));
    w->ok = (char *)calloc(n ? n : 1, 1);
    w->q = (job_t *)calloc(w->cap, sizeof(job_t));
    w->pid = getpid();
    if (!w->sizes || !w->sums || !w->snap || !w->posted || !w->done || !w->ok || !w->q) goto nomem;
    for (Py_ssize_t k = 0; k < n; k++) {
        w->sizes[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, k));
        if (w->sizes[k] < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "norms_open: a negative size");
            goto fail;
        }
    }
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
#if defined(__linux__)
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
#endif
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->work, &ca);
    pthread_cond_init(&w->idle, &ca);
    pthread_condattr_destroy(&ca);
    PyObject *cap = PyCapsule_New(w, CAPSULE, destroy);
    if (cap) return cap;
    goto fail;
nomem:
    PyErr_NoMemory();
fail:
    free(w->sizes), free(w->sums), free(w->snap), free(w->posted), free(w->done), free(w->ok), free(w->q);
    free(w);
    return NULL;
}

static normw_t *worker_of(PyObject *cap) {
    return (normw_t *)PyCapsule_GetPointer(cap, CAPSULE); /* NULL with a TypeError/ValueError set */
}

PyObject *gw_norms_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "norms_post(cap, grad, slot)");
        return NULL;
    }
    normw_t *w = worker_of(args[0]);
    if (!w) return NULL;
    Py_ssize_t slot = PyLong_AsSsize_t(args[2]);
    if (slot == -1 && PyErr_Occurred()) return NULL;
    if (slot < 0 || slot >= w->nslots || w->pid != getpid() || w->stop || !w->sizes[slot]) Py_RETURN_FALSE;
    PyObject *dt;
    Py_ssize_t nb;
    const float *p = (const float *)gw_tensor_data(args[1], &dt, 0, w->sizes[slot] * 4, &nb);
    if (!p) Py_RETURN_FALSE;
    if (!w->started) {
        if (pthread_create(&w->th, NULL, run, w) != 0) Py_RETURN_FALSE;
        w->started = 1;
    }
    PyObject *refs[16];
    size_t nd;
    do { /* every finished job's reference goes now, 16 at a time (a drop may run Python code that posts) */
        pthread_mutex_lock(&w->mu);
        nd = collect_drops(w, w->head, refs, 16);
        pthread_mutex_unlock(&w->mu);
        drop_refs(refs, nd);
    } while (nd == 16);
    pthread_mutex_lock(&w->mu);
    int ok = w->tail - w->rel < w->cap;
    if (ok) {
        Py_INCREF(args[1]);
        job_t *j = &w->q[w->tail % w->cap];
        j->t = args[1], j->p = p, j->n = w->sizes[slot], j->slot = slot, j->seq = ++w->seq;
        w->posted[slot] = j->seq;
        w->tail++;
        pthread_cond_signal(&w->work);
    }
    pthread_mutex_unlock(&w->mu);
    return PyBool_FromLong(ok);
}

PyObject *gw_norms_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "norms_take(cap, timeout_s)");
        return NULL;
    }
    normw_t *w = worker_of(args[0]);
    if (!w) return NULL;
    double timeout = PyFloat_AsDouble(args[1]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    if (w->pid != getpid()) Py_RETURN_NONE;
    int finished = 1;
    PyObject **refs = (PyObject **)malloc(w->cap * sizeof(PyObject *));
    if (!refs) return PyErr_NoMemory();
    size_t nd = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->mu);
    if (w->head != w->tail) {
        struct timespec dl;
#if defined(__linux__)
        clock_gettime(CLOCK_MONOTONIC, &dl);
#else
        clock_gettime(CLOCK_REALTIME, &dl);
#endif
        double whole = (double)(time_t)timeout;
        dl.tv_sec += (time_t)timeout;
        dl.tv_nsec += (long)((timeout - whole) * 1e9);
        if (dl.tv_nsec >= 1000000000L) dl.tv_sec++, dl.tv_nsec -= 1000000000L;
        while (w->head != w->tail && !w->stop)
            if (pthread_cond_timedwait(&w->idle, &w->mu, &dl) == ETIMEDOUT) break;
        finished = w->head == w->tail;
    }
    for (Py_ssize_t k = 0; k < w->nslots; k++) { /* copied under the lock, turned into floats after it */
        w->ok[k] = w->posted[k] != 0 && w->done[k] == w->posted[k];
        w->snap[k] = w->sums[k];
        if (finished) w->posted[k] = 0;
    }
    nd = collect_drops(w, w->head, refs, w->cap);
    pthread_mutex_unlock(&w->mu); /* before the GIL again: never wait for the GIL holding the lock */
    Py_END_ALLOW_THREADS
    drop_refs(refs, nd);
    free(refs);
    if (!finished) Py_RETURN_NONE;
    PyObject *out = PyList_New(w->nslots);
    if (!out) return NULL;
    for (Py_ssize_t k = 0; k < w->nslots; k++) {
        PyObject *v = w->ok[k] ? PyFloat_FromDouble(w->snap[k]) : Py_NewRef(Py_None);
        if (!v) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k, v);
    }
    return out;
}

PyObject *gw_norms_close(PyObject *self, PyObject *cap) {
    (void)self;
    normw_t *w = worker_of(cap);
    if (!w) return NULL;
    if (w->pid == getpid()) {
        Py_BEGIN_ALLOW_THREADS
        stop_join(w);
        Py_END_ALLOW_THREADS
        drop_all(w);
    }
    Py_RETURN_NONE;
}
#endif
