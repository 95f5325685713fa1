/* The steady step's one compiled call: per-tensor sums of squares of a small CPU model's gradients, read in
 * place, and its tiny batches as float32, written into one buffer that becomes the step's record.
 *
 * Why (docs/design.md, "The native steady step"; bench/README.md 1.16): on a small CPU model the
 * steady step copied every gradient into a shared-memory slot (~20 us with caches cold from backward)
 * so that the sidecar could take the norms there, then took the total with torch.dot; every Python or
 * torch statement of it cost about as much again in the training step's own phases. One pass over the
 * gradients in C, where they lie, gives the per-tensor sums the sidecar would have computed, the total
 * for the trouble check and whether everything is finite, and leaves no slot to hand over.
 *
 * Safety first: a tensor is read only when it is exactly torch.Tensor (no subclass), on the CPU, of a
 * known dtype, contiguous and of the expected byte size. Anything else answers -1 ("not mine", the
 * caller takes the copying path) without reading a byte. Errors from torch's attribute calls are
 * cleared and answered -1 as well: this runs inside a training loop.
 *
 * grad_sumsq(grads: list, sizes: tuple[int, ...], batches: tuple, out: writable buffer) -> float
 *   out: len(grads) float64 sums of squares, then every batch value as float32 (batches in order).
 *   returns the total sum of squares (>= 0) when every gradient and batch value is finite; NaN or inf when
 *   one is not (a sum that overflows float32 lanes is taken again in float64, where a finite float32 squared
 *   cannot overflow: sumsq_avx2); -1.0 when not eligible.
 * param_grad_sumsq(params: list, ...[, loss]): the same, reading each parameter's .grad (no list built in
 *   Python); given a fifth argument, the step's loss, it answers (total, the loss's value) instead, the value
 *   None where the loss is not a one-element float32/float64 CPU tensor it can read (or the pass refused).
 * weight_pass(params, sizes, batches, out, snap, settle) -> float: a detail step's or a settle's pass. out:
 *   per tensor the gradient's sum of squares, then (detail) its max |g| and the weight's sum of squares, the
 *   weights copied into snap (float32, all tensors in order; snap may be None), or (settle) the sum of
 *   squares of snap - weight (the update since the detail step, each difference rounded to float32 as a
 *   float32 subtraction would); then the batches. Answers as grad_sumsq, NaN/inf also for a weight.
 *
 * batch_stats(t) -> (numel, nonfinite, min, max, sum, sumsq) | None: a big batch's statistics in one pass.
 *
 * norms_open / norms_post / norms_take / norms_close: the gradient-norm worker thread (_native_norms.c).
 *
 * ring_put(mm, base, cap, w_at, r_at, parts: tuple) -> bool: ring.py's Ring._write of one record given in
 *   pieces (no concatenated copy, no Python statements per record): the 4-byte little-endian length, the
 *   pieces, wrapping at the end of the ring, then the writer's position stored with release order (the
 *   reader sees all of the record or none of it, on any CPU). False when it does not fit now.
 */
#define GRADWATCH_NATIVE_ABI 7 /* bump with any change of a function's arguments or answers (native.ABI too) */
#include "_native.h"
#include <math.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

static PyObject *s_dtype, *s_is_cpu, *s_nbytes, *s_is_contiguous, *s_data_ptr;
static PyObject *tensor_type, *param_type, *dt_f32, *dt_f64, *dt_i64, *dt_i32;
static int have_avx2;
static PyObject **const dts[4] = {&dt_f32, &dt_f64, &dt_i64, &dt_i32}; /* the shim's dtype kinds (_native.h) */

typedef double v2d __attribute__((vector_size(16)));

#if defined(__x86_64__) || defined(__i386__)
static double sumsq_plain(const float *x, Py_ssize_t n);
/* Squares summed in float32 lanes over blocks of 256 values (each lane adds 8 squares, so the total is within
 * ~5e-7 of the float64 sum -- measured <= 3e-8 over 1 to 3M values, 20 seeds, 1e-20 to 1e19 -- where torch's
 * own float32 norm of a 100k-value tensor is ~1e-6 off), the blocks' sums in float64. Faster than converting
 * every value to float64 first (a 4 MB gradient: ~140 against ~200 us warm, ~190 against ~300 us cold;
 * torch's _foreach_norm 150-170 / 210-310), which is what the norm worker and the steady step spend their
 * time on. A finite float32 square can overflow a float32 lane, and squares under ~1e-38 lose their digits in
 * one (torch's norm of a gradient of 1e-23s is a third of the truth, of 1e-25s 0): so a total that is not
 * finite, or under 1e-20 (where such squares could matter), is taken again in float64 (sumsq_plain): NaN or
 * inf then means a non-finite value, and a tiny gradient's norm is exact, as before. */
__attribute__((target("avx2,fma"))) static double sumsq_avx2(const float *x, Py_ssize_t n) {
    __m256d t0 = _mm256_setzero_pd(), t1 = _mm256_setzero_pd();
    Py_ssize_t i = 0;
    for (; i + 256 <= n; i += 256) {
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        for (Py_ssize_t j = i; j < i + 256; j += 32) {
            __m256 v0 = _mm256_loadu_ps(x + j), v1 = _mm256_loadu_ps(x + j + 8);
            __m256 v2 = _mm256_loadu_ps(x + j + 16), v3 = _mm256_loadu_ps(x + j + 24);
            a0 = _mm256_fmadd_ps(v0, v0, a0);
            a1 = _mm256_fmadd_ps(v1, v1, a1);
            a2 = _mm256_fmadd_ps(v2, v2, a2);
            a3 = _mm256_fmadd_ps(v3, v3, a3);
        }
        __m256 a01 = _mm256_add_ps(a0, a1), a23 = _mm256_add_ps(a2, a3);
        t0 = _mm256_add_pd(t0, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a01)),
                                             _mm256_cvtps_pd(_mm256_extractf128_ps(a01, 1))));
        t1 = _mm256_add_pd(t1, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(a23)),
                                             _mm256_cvtps_pd(_mm256_extractf128_ps(a23, 1))));
    }
    double d[4];
    _mm256_storeu_pd(d, _mm256_add_pd(t0, t1));
    double r = (d[0] + d[1]) + (d[2] + d[3]);
    for (; i < n; i++) {
        double v = x[i];
        r += v * v;
    }
    return isfinite(r) && r >= 1e-20 ? r : sumsq_plain(x, n);
}
#else
#define sumsq_avx2 sumsq_plain
#endif

static double sumsq_plain(const float *x, Py_ssize_t n) {  /* SSE2, the x86-64 baseline (or any target) */
    v2d a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        v2d d0 = {x[i], x[i + 1]}, d1 = {x[i + 2], x[i + 3]}, d2 = {x[i + 4], x[i + 5]}, d3 = {x[i + 6], x[i + 7]};
        a0 += d0 * d0; a1 += d1 * d1; a2 += d2 * d2; a3 += d3 * d3;
    }
    v2d s = (a0 + a1) + (a2 + a3);
    double r = s[0] + s[1];
    for (; i < n; i++) {
        double v = x[i];
        r += v * v;
    }
    return r;
}

/* The data of `t` when it is an exact torch.Tensor on the CPU, contiguous, with dtype `*dt` among the
 * allowed ones and `nbytes` bytes (0 = any; then *nb gets them); NULL otherwise (any error cleared). */
static const void *tensor_data(PyObject *t, PyObject **dt, int batch, Py_ssize_t want, Py_ssize_t *nb) {
    PyObject *o;
    /* a parameter itself (batch == 2: exactly nn.Parameter, whose data is the tensor's own) or a tensor */
    if ((PyObject *)Py_TYPE(t) != tensor_type && !(batch == 2 && (PyObject *)Py_TYPE(t) == param_type)) return NULL;
    if (gw_shim_bound()) {  /* the same questions through torch's C shim (_native_shim.c) */
        int kind;
        int64_t numel;
        const void *data;
        if (!gw_shim_tensor(t, &kind, &numel, &data) || kind < 0 || (kind > 0 && batch != 1) || !data) return NULL;
        Py_ssize_t n = (Py_ssize_t)numel * (kind == 0 || kind == 3 ? 4 : 8);
        if (want && n != want) return NULL;
        *dt = *dts[kind];
        *nb = n;
        return data;
    }
    if (!(o = PyObject_GetAttr(t, s_dtype))) goto error;
    Py_DECREF(o);  /* the dtype objects are torch's singletons: a borrowed identity is enough */
    if (!(o == dt_f32 || (batch == 1 && (o == dt_f64 || o == dt_i64 || o == dt_i32)))) return NULL;
    *dt = o;
    if (!(o = PyObject_GetAttr(t, s_is_cpu))) goto error;
    Py_DECREF(o);
    if (o != Py_True) return NULL;
    if (!(o = PyObject_GetAttr(t, s_nbytes))) goto error;
    Py_ssize_t n = PyLong_AsSsize_t(o);
    Py_DECREF(o);
    if (n < 0 || (want && n != want)) goto error;
    *nb = n;
    if (!(o = PyObject_CallMethodNoArgs(t, s_is_contiguous))) goto error;
    Py_DECREF(o);
    if (o != Py_True) return NULL;
    if (!(o = PyObject_CallMethodNoArgs(t, s_data_ptr))) goto error;
    void *p = PyLong_AsVoidPtr(o);
    Py_DECREF(o);
    if (!p) goto error;
    return p;
error:
    PyErr_Clear();
    return NULL;
}

GW_HIDDEN double gw_sumsq(const float *x, Py_ssize_t n) {
    return have_avx2 ? sumsq_avx2(x, n) : sumsq_plain(x, n);
}

GW_HIDDEN int gw_is_tensor_type(PyObject *t) {
    return tensor_type && ((PyObject *)Py_TYPE(t) == tensor_type || (PyObject *)Py_TYPE(t) == param_type);
}

/* tensor_facts(t, batch) -> (data pointer, nbytes, dtype) | None: what the passes see of a tensor (the tests' and
 * native.py's check of the shim against the attribute calls). */
static PyObject *tensor_facts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    long batch;
    if (nargs != 2 || (batch = PyLong_AsLong(args[1])) < 0 || batch > 2) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "tensor_facts(t, batch: 0, 1 or 2)");
        return NULL;
    }
    if (!tensor_type) {
        PyErr_SetString(PyExc_RuntimeError, "tensor_facts: configure() first");
        return NULL;
    }
    PyObject *dt;
    Py_ssize_t nb;
    const void *p = tensor_data(args[0], &dt, (int)batch, 0, &nb);
    if (!p) Py_RETURN_NONE;
    return Py_BuildValue("(NnO)", PyLong_FromVoidPtr((void *)p), nb, dt);
}

GW_HIDDEN const void *gw_tensor_data(PyObject *t, PyObject **dt, int batch, Py_ssize_t want, Py_ssize_t *nb) {
    return tensor_data(t, dt, batch, want, nb);
}

static PyObject *s_grad;
static int put_batches(PyObject *batches, char *at, char *end, int *finite);

/* The value of a one-element float32/float64 CPU tensor (the loss), read as the batches are; 0 when not. */
static int scalar_value(PyObject *t, double *v) {
    PyObject *dt;
    Py_ssize_t nb;
    const void *p = tensor_data(t, &dt, 1, 0, &nb);
    if (p && dt == dt_f32 && nb == 4) {
        *v = *(const float *)p;
        return 1;
    }
    if (p && dt == dt_f64 && nb == 8) {
        memcpy(v, p, 8);
        return 1;
    }
    return 0;
}

static PyObject *sumsq_common(PyObject *const *args, Py_ssize_t nargs, int via_grad) {
    if (nargs < 4 || nargs > 4 + via_grad || !PyList_CheckExact(args[0]) || !PyTuple_CheckExact(args[1])
        || !PyTuple_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "grad_sumsq(grads: list, sizes: tuple, batches: tuple, out: buffer)");
        return NULL;
    }
    if (!tensor_type) {
        PyErr_SetString(PyExc_RuntimeError, "grad_sumsq: configure() first");
        return NULL;
    }
    PyObject *grads = args[0], *sizes = args[1], *batches = args[2];
    Py_ssize_t n = PyList_GET_SIZE(grads);
    Py_buffer view;
    if (PyObject_GetBuffer(args[3], &view, PyBUF_WRITABLE) < 0) return NULL;
    double result = -1.0, total = 0.0;
    int finite = 1;
    if (PyTuple_GET_SIZE(sizes) != n || view.len < (Py_ssize_t)(n * sizeof(double))) goto done;
    char *sums = (char *)view.buf;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, k)), nb;
        PyObject *dt;
        if (size < 0) {
            PyErr_Clear();
            goto done;
        }
        PyObject *g = PyList_GET_ITEM(grads, k);
        /* the parameter's .grad: a new reference, dropped only after the read */
        if (via_grad && !(g = PyObject_GetAttr(g, s_grad))) {
            PyErr_Clear();
            goto done;
        }
        const float *p = size ? tensor_data(g, &dt, 0, size * 4, &nb) : NULL;
        double s = !p ? 0.0 : have_avx2 ? sumsq_avx2(p, size) : sumsq_plain(p, size);
        if (via_grad) Py_DECREF(g);
        if (size && !p) goto done;
        memcpy(sums + k * sizeof(double), &s, sizeof s);  /* any alignment */
        total += s;
    }
    if (!put_batches(batches, (char *)view.buf + n * sizeof(double), (char *)view.buf + view.len, &finite)) goto done;
    result = finite ? total : NAN;
done:
    PyBuffer_Release(&view);
    if (nargs == 5) {  /* with the loss: (total, its value or None when it is not a tensor read here) */
        double v;
        if (result != -1.0 && scalar_value(args[4], &v)) return Py_BuildValue("(dd)", result, v);
        return Py_BuildValue("(dO)", result, Py_None);
    }
    return PyFloat_FromDouble(result);
}

/* Every batch value as float32 from `at` on, exactly filling up to `end`; 0 when a batch is not readable or
 * the space is another size. *finite is cleared by a value that is not. */
static int put_batches(PyObject *batches, char *at, char *end, int *finite) {
    for (Py_ssize_t b = 0; b < PyTuple_GET_SIZE(batches); b++) {
        PyObject *dt;
        Py_ssize_t nb;
        const void *p = tensor_data(PyTuple_GET_ITEM(batches, b), &dt, 1, 0, &nb);
        if (!p) return 0;
        Py_ssize_t count = nb / (dt == dt_f32 || dt == dt_i32 ? 4 : 8);
        if (count * 4 > end - at) return 0;
        float *o = (float *)at;
        if (dt == dt_f32) {
            memcpy(o, p, count * 4);
        } else if (dt == dt_f64) {
            for (Py_ssize_t i = 0; i < count; i++) o[i] = (float)((const double *)p)[i];
        } else if (dt == dt_i64) {
            for (Py_ssize_t i = 0; i < count; i++) o[i] = (float)((const int64_t *)p)[i];
        } else {
            for (Py_ssize_t i = 0; i < count; i++) o[i] = (float)((const int32_t *)p)[i];
        }
        for (Py_ssize_t i = 0; i < count; i++) *finite &= isfinite(o[i]) != 0;
        at += count * 4;
    }
    return at == end;  /* the buffer is sized for these batches: anything else is another shape */
}

static PyObject *grad_sumsq(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return sumsq_common(args, nargs, 0);
}

static PyObject *param_grad_sumsq(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    return sumsq_common(args, nargs, 1);
}

#if defined(__x86_64__) || defined(__i386__)
/* AVX2 versions of the two loops below (a NaN's max-abs does not matter: the step's total is NaN then) */
__attribute__((target("avx2,fma"))) static double maxabs_avx2(const float *x, Py_ssize_t n) {
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        m0 = _mm256_max_ps(m0, _mm256_and_ps(_mm256_loadu_ps(x + i), mask));
        m1 = _mm256_max_ps(m1, _mm256_and_ps(_mm256_loadu_ps(x + i + 8), mask));
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_max_ps(m0, m1));
    float m = 0.0f;
    for (int j = 0; j < 8; j++) m = t[j] > m ? t[j] : m;
    for (; i < n; i++) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    return m;
}

__attribute__((target("avx2,fma"))) static double diffsq_avx2(const float *a, const float *b, Py_ssize_t n) {
    __m256d r0 = _mm256_setzero_pd(), r1 = _mm256_setzero_pd(), r2 = _mm256_setzero_pd(), r3 = _mm256_setzero_pd();
    Py_ssize_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 d = _mm256_sub_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i));  /* float32, as numpy's */
        __m256 e = _mm256_sub_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8));
        __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(d)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(d, 1));
        __m256d e0 = _mm256_cvtps_pd(_mm256_castps256_ps128(e)), e1 = _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1));
        r0 = _mm256_fmadd_pd(d0, d0, r0);
        r1 = _mm256_fmadd_pd(d1, d1, r1);
        r2 = _mm256_fmadd_pd(e0, e0, r2);
        r3 = _mm256_fmadd_pd(e1, e1, r3);
    }
    double t[4];
    _mm256_storeu_pd(t, _mm256_add_pd(_mm256_add_pd(r0, r1), _mm256_add_pd(r2, r3)));
    double r = (t[0] + t[1]) + (t[2] + t[3]);
    for (; i < n; i++) {
        double d = (float)(a[i] - b[i]);
        r += d * d;
    }
    return r;
}
#else
#define maxabs_avx2 maxabs_f32
#define diffsq_avx2 diffsq_f32
#endif

static double maxabs_f32(const float *x, Py_ssize_t n) {
    float m = 0.0f;
    for (Py_ssize_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    return m;
}

static double diffsq_f32(const float *a, const float *b, Py_ssize_t n) {
    double r0 = 0, r1 = 0, r2 = 0, r3 = 0;
    Py_ssize_t i = 0;
    for (; i + 4 <= n; i += 4) {
        double d0 = (float)(a[i] - b[i]), d1 = (float)(a[i + 1] - b[i + 1]);
        double d2 = (float)(a[i + 2] - b[i + 2]), d3 = (float)(a[i + 3] - b[i + 3]);
        r0 += d0 * d0; r1 += d1 * d1; r2 += d2 * d2; r3 += d3 * d3;
    }
    for (; i < n; i++) {
        double d = (float)(a[i] - b[i]);
        r0 += d * d;
    }
    return (r0 + r1) + (r2 + r3);
}

static PyObject *weight_pass(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !PyList_CheckExact(args[0]) || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "weight_pass(params: list, sizes: tuple, batches: tuple, out, snap, settle)");
        return NULL;
    }
    if (!tensor_type || !param_type) {
        PyErr_SetString(PyExc_RuntimeError, "weight_pass: configure() first");
        return NULL;
    }
    PyObject *params = args[0], *sizes = args[1];
    int settle = PyObject_IsTrue(args[5]);
    if (settle < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(params), per = settle ? 2 : 3, all = 0;
    Py_buffer view, snap = {0};
    int have_snap = args[4] != Py_None;
    if (PyObject_GetBuffer(args[3], &view, PyBUF_WRITABLE) < 0) return NULL;
    if (have_snap && PyObject_GetBuffer(args[4], &snap, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    double result = -1.0, total = 0.0;
    int finite = 1;
    if (PyTuple_GET_SIZE(sizes) != n || view.len < (Py_ssize_t)(per * n * sizeof(double)) || (settle && !have_snap))
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, k));
        if (size <= 0 || size > PY_SSIZE_T_MAX / 4 - all) {
            PyErr_Clear();
            goto done;
        }
        all += size;
    }
    if (have_snap && snap.len != all * 4) goto done;
    char *o = (char *)view.buf;
    float *sn = have_snap ? (float *)snap.buf : NULL;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *p = PyList_GET_ITEM(params, k), *dt;
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(sizes, k)), nb;
        const float *w = tensor_data(p, &dt, 2, size * 4, &nb);
        if (!w) goto done;
        PyObject *g = PyObject_GetAttr(p, s_grad);
        if (!g) {
            PyErr_Clear();
            goto done;
        }
        const float *gp = tensor_data(g, &dt, 0, size * 4, &nb);
        double v[3];
        if (gp) {
            v[0] = have_avx2 ? sumsq_avx2(gp, size) : sumsq_plain(gp, size);
            if (settle) {
                v[1] = have_avx2 ? diffsq_avx2(sn, w, size) : diffsq_f32(sn, w, size);
            } else {
                v[1] = have_avx2 ? maxabs_avx2(gp, size) : maxabs_f32(gp, size);
                v[2] = have_avx2 ? sumsq_avx2(w, size) : sumsq_plain(w, size);
                if (sn) memcpy(sn, w, size * 4);
            }
        }
        Py_DECREF(g);  /* the gradient is the parameter's: alive until here, read by now */
        if (!gp) goto done;
        for (Py_ssize_t j = 0; j < per; j++) {
            memcpy(o + (j * n + k) * sizeof(double), &v[j], sizeof(double));
            if (j) finite &= isfinite(v[j]) != 0;
        }
        total += v[0];
        if (sn) sn += size;
    }
    if (!put_batches(args[2], o + per * n * sizeof(double), o + view.len, &finite)) goto done;
    result = finite ? total : NAN;
done:
    if (have_snap) PyBuffer_Release(&snap);
    PyBuffer_Release(&view);
    return PyFloat_FromDouble(result);
}

/* batch_stats(t) -> (numel, nonfinite, min, max, sum, sum of squares) over the finite values of a float32,
 * float64, int64 or int32 CPU batch read in place (sums in float64), or None when it is not one (data_stats.py:
 * one pass instead of aminmax, sum, dot and four .item() calls, ~100 us with caches cold on a 64x1024 batch). */
#define STATS_LOOP(T, FROM)                                                       \
    for (Py_ssize_t i = (FROM); i < count; i++) {                                 \
        double v = (double)((const T *)p)[i];                                     \
        if (!isfinite(v)) {                                                       \
            nonfinite++;                                                          \
            continue;                                                             \
        }                                                                         \
        lo = v < lo ? v : lo;                                                     \
        hi = v > hi ? v : hi;                                                     \
        s += v;                                                                   \
        ss += v * v;                                                              \
    }
#if defined(__x86_64__) || defined(__i386__)
/* STATS_LOOP(float) in AVX2 over whole groups of 8: the non-finite lanes masked out of min, max and both sums,
 * and counted; answers where it stopped. */
__attribute__((target("avx2,fma"))) static Py_ssize_t stats_f32_avx2(const float *x, Py_ssize_t count, Py_ssize_t *nonfinite,
                                                               double *lo, double *hi, double *s, double *ss) {
    const __m256 zero = _mm256_setzero_ps(), pinf = _mm256_set1_ps(INFINITY), ninf = _mm256_set1_ps(-INFINITY);
    __m256 mn = pinf, mx = ninf;
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd(), q0 = _mm256_setzero_pd(), q1 = _mm256_setzero_pd();
    Py_ssize_t i = 0, bad = 0;
    for (; i + 8 <= count; i += 8) {  /* (a second lane of accumulators measured no faster: 24 vs 25 us warm) */
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 ok = _mm256_cmp_ps(_mm256_sub_ps(v, v), zero, _CMP_EQ_OQ);  /* v - v is 0 iff v is finite */
        bad += 8 - __builtin_popcount(_mm256_movemask_ps(ok));
        mn = _mm256_min_ps(mn, _mm256_blendv_ps(pinf, v, ok));
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(ninf, v, ok));
        __m256 z = _mm256_and_ps(v, ok);
        __m256d d0 = _mm256_cvtps_pd(_mm256_castps256_ps128(z)), d1 = _mm256_cvtps_pd(_mm256_extractf128_ps(z, 1));
        s0 = _mm256_add_pd(s0, d0);
        s1 = _mm256_add_pd(s1, d1);
        q0 = _mm256_fmadd_pd(d0, d0, q0);
        q1 = _mm256_fmadd_pd(d1, d1, q1);
    }
    float a[8], b[8];
    double c[4], d[4];
    _mm256_storeu_ps(a, mn);
    _mm256_storeu_ps(b, mx);
    _mm256_storeu_pd(c, _mm256_add_pd(s0, s1));
    _mm256_storeu_pd(d, _mm256_add_pd(q0, q1));
    double l = INFINITY, h = -INFINITY, sum = (c[0] + c[1]) + (c[2] + c[3]), sq = (d[0] + d[1]) + (d[2] + d[3]);
    for (int j = 0; j < 8; j++) {
        l = a[j] < l ? a[j] : l;
        h = b[j] > h ? b[j] : h;
    }
    *nonfinite = bad, *lo = l, *hi = h, *s = sum, *ss = sq;
    return i;  /* the rest (under 8 values) is the caller's scalar loop */
}
#endif

static PyObject *batch_stats(PyObject *self, PyObject *t) {
    (void)self;
    PyObject *dt;
    Py_ssize_t nb;
    if (!tensor_type) {
        PyErr_SetString(PyExc_RuntimeError, "batch_stats: configure() first");
        return NULL;
    }
    const void *p = tensor_data(t, &dt, 1, 0, &nb);
    if (!p) Py_RETURN_NONE;
    Py_ssize_t count = nb / (dt == dt_f32 || dt == dt_i32 ? 4 : 8), nonfinite = 0;
    double lo = INFINITY, hi = -INFINITY, s = 0.0, ss = 0.0;
    Py_BEGIN_ALLOW_THREADS  /* the batch is the caller's until it returns; nothing here touches Python */
    if (dt == dt_f32) {
        Py_ssize_t from = 0;
#if defined(__x86_64__) || defined(__i386__)
        if (have_avx2) from = stats_f32_avx2((const float *)p, count, &nonfinite, &lo, &hi, &s, &ss);
#endif
        STATS_LOOP(float, from)
    } else if (dt == dt_f64) {
        STATS_LOOP(double, 0)
    } else if (dt == dt_i64) {
        STATS_LOOP(int64_t, 0)
    } else {
        STATS_LOOP(int32_t, 0)
    }
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(dddddd)", (double)count, (double)nonfinite, lo, hi, s, ss);
}

static void ring_copy(char *ring, Py_ssize_t cap, Py_ssize_t off, const char *src, Py_ssize_t n) {
    Py_ssize_t first = cap - off < n ? cap - off : n;
    memcpy(ring + off, src, first);
    if (first < n) memcpy(ring, src + first, n - first);
}

#define RING_PARTS 8
static PyObject *ring_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 6 || !PyTuple_CheckExact(args[5]) || PyTuple_GET_SIZE(args[5]) > RING_PARTS) {
        PyErr_SetString(PyExc_TypeError, "ring_put(mm, base, cap, w_at, r_at, parts: tuple of at most 8)");
        return NULL;
    }
    Py_ssize_t base = PyLong_AsSsize_t(args[1]), cap = PyLong_AsSsize_t(args[2]);
    Py_ssize_t w_at = PyLong_AsSsize_t(args[3]), r_at = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    Py_buffer mm, parts[RING_PARTS];
    Py_ssize_t np = PyTuple_GET_SIZE(args[5]), got = 0, size = 0;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(args[0], &mm, PyBUF_WRITABLE) < 0) return NULL;
    if (base < 0 || cap <= 0 || base + cap > mm.len || w_at < 0 || r_at < 0 || w_at % 8 || r_at % 8
        || w_at + 8 > mm.len || r_at + 8 > mm.len || ((uintptr_t)mm.buf) % 8) {
        PyErr_SetString(PyExc_ValueError, "ring_put: positions outside the mapping");
        goto out;
    }
    for (; got < np; got++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args[5], got), &parts[got], PyBUF_SIMPLE) < 0) goto out;
        size += parts[got].len;
    }
    if (size > 0xFFFFFFFFLL) {
        PyErr_SetString(PyExc_ValueError, "ring_put: record too large");
        goto out;
    }
    char *buf = (char *)mm.buf;
    uint64_t *wp = (uint64_t *)(buf + w_at), *rp = (uint64_t *)(buf + r_at);
    uint64_t w = __atomic_load_n(wp, __ATOMIC_RELAXED);  /* ours: only this side writes it */
    uint64_t r = __atomic_load_n(rp, __ATOMIC_ACQUIRE);  /* the reader's reads of that space are done */
    uint64_t n = 4 + (uint64_t)size;
    if (w < r || n > (uint64_t)cap - (w - r)) {
        result = Py_NewRef(Py_False);
        goto out;
    }
    Py_ssize_t off = (Py_ssize_t)(w % (uint64_t)cap);
    unsigned char len[4] = {size & 0xFF, (size >> 8) & 0xFF, (size >> 16) & 0xFF, (size >> 24) & 0xFF};
    ring_copy(buf + base, cap, off, (const char *)len, 4);
    off = (off + 4) % cap;
    for (Py_ssize_t i = 0; i < np; i++) {
        ring_copy(buf + base, cap, off, (const char *)parts[i].buf, parts[i].len);
        off = (off + parts[i].len) % cap;
    }
    __atomic_store_n(wp, w + n, __ATOMIC_RELEASE);  /* after the record: all of it or none */
    result = Py_NewRef(Py_True);
out:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&parts[i]);
    PyBuffer_Release(&mm);
    return result;
}

static PyObject *configure(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "configure(Tensor, Parameter, float32, float64, int64, int32)");
        return NULL;
    }
    PyObject **slots[6] = {&tensor_type, &param_type, &dt_f32, &dt_f64, &dt_i64, &dt_i32};
    for (int i = 0; i < 6; i++) {
        Py_INCREF(args[i]);
        Py_XSETREF(*slots[i], args[i]);
    }
    Py_RETURN_NONE;
}

static PyObject *simd(PyObject *self, PyObject *unused) {
    return PyUnicode_FromString(have_avx2 ? "avx2" : "baseline");
}

static PyMethodDef methods[] = {
    {"grad_sumsq", (PyCFunction)(void (*)(void))grad_sumsq, METH_FASTCALL,
     "grad_sumsq(grads, sizes, batches, out) -> total sum of squares, NaN/inf if non-finite, -1.0 if not eligible"},
    {"param_grad_sumsq", (PyCFunction)(void (*)(void))param_grad_sumsq, METH_FASTCALL,
     "param_grad_sumsq(params, sizes, batches, out[, loss]): grad_sumsq of each parameter's .grad (and the loss)"},
    {"weight_pass", (PyCFunction)(void (*)(void))weight_pass, METH_FASTCALL,
     "weight_pass(params, sizes, batches, out, snap, settle): a detail step's or a settle's pass"},
    {"ring_put", (PyCFunction)(void (*)(void))ring_put, METH_FASTCALL,
     "ring_put(mm, base, cap, w_at, r_at, parts) -> bool: one record into a ring of ring.py"},
    {"batch_stats", batch_stats, METH_O,
     "batch_stats(t) -> (numel, nonfinite, min, max, sum, sum of squares) of a CPU batch, or None"},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(torch.Tensor, nn.Parameter, float32, float64, int64, int32): the types the passes read"},
    {"simd", simd, METH_NOARGS, "which kernel runs: 'avx2' or 'baseline'"},
    {"tensor_facts", (PyCFunction)(void (*)(void))tensor_facts, METH_FASTCALL,
     "tensor_facts(t, batch) -> (data pointer, nbytes, dtype) as the passes read t, or None when they refuse it"},
    {"batch_key", (PyCFunction)(void (*)(void))gw_batch_key, METH_FASTCALL,
     "batch_key(inputs, targets) -> bytes of their shapes, dtypes, devices, layouts (torch's C shim), or None"},
    {"shim_bind", (PyCFunction)(void (*)(void))gw_shim_bind, METH_FASTCALL,
     "shim_bind(torch library path or None, probes, their _cdata) -> '' when torch's C shim answers, else why not"},
#ifdef GW_NORM_WORKER
    {"norms_open", gw_norms_open, METH_O, "norms_open(sizes) -> the gradient-norm worker (a capsule)"},
    {"norms_post", (PyCFunction)(void (*)(void))gw_norms_post, METH_FASTCALL,
     "norms_post(worker, grad, slot) -> bool: its sum of squares, taken by the worker thread"},
    {"norms_take", (PyCFunction)(void (*)(void))gw_norms_take, METH_FASTCALL,
     "norms_take(worker, timeout_s) -> per slot the sum of squares posted since the last take, or None"},
    {"norms_close", gw_norms_close, METH_O, "norms_close(worker): stop its thread, drop its references"},
#endif
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gradwatch.publisher._native",
                                    "The steady step's compiled call (see _native.c).", -1, methods};

PyMODINIT_FUNC PyInit__native(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    if (!(s_dtype = PyUnicode_InternFromString("dtype")) || !(s_is_cpu = PyUnicode_InternFromString("is_cpu"))
        || !(s_nbytes = PyUnicode_InternFromString("nbytes"))
        || !(s_is_contiguous = PyUnicode_InternFromString("is_contiguous"))
        || !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) || !(s_grad = PyUnicode_InternFromString("grad")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    /* what native.py and ring.py check before they use it: a build left over from another source is not used */
    if (m && PyModule_AddIntConstant(m, "ABI", GRADWATCH_NATIVE_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
