/* What the parts of gradwatch.publisher._native share (_native.c: the passes; _native_norms.c: the norm worker). */
#ifndef GRADWATCH_NATIVE_H
#define GRADWATCH_NATIVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#if defined(__GNUC__)
#define GW_HIDDEN __attribute__((visibility("hidden")))
#else
#define GW_HIDDEN
#endif

/* The float64 sum of squares of n float32 values, by the best kernel this CPU runs (no Python: any thread). */
GW_HIDDEN double gw_sumsq(const float *x, Py_ssize_t n);
/* _native.c's tensor_data: the data of an exact, CPU, contiguous torch.Tensor of an allowed dtype and size,
 * else NULL (errors cleared). Needs the GIL. */
GW_HIDDEN const void *gw_tensor_data(PyObject *t, PyObject **dt, int batch, Py_ssize_t want, Py_ssize_t *nb);

/* exactly torch.Tensor or nn.Parameter (configure()'s types): the objects whose layout _native_shim.c knows */
GW_HIDDEN int gw_is_tensor_type(PyObject *t);

#ifndef _WIN32
#define GW_HAVE_SHIM 1
#endif
/* _native_shim.c: whether torch's C shim answers for the attribute calls (shim_bind succeeded), and its answer for
 * an exact tensor: 1 with *kind (0 float32, 1 float64, 2 int64, 3 int32, -1 another dtype), *numel and *data when
 * it is a strided, contiguous CPU tensor; 0 when not (or the shim failed). Needs the GIL only as the tensor's
 * owner does: the object must stay alive. */
GW_HIDDEN int gw_shim_bound(void);
GW_HIDDEN int gw_shim_tensor(PyObject *t, int *kind, int64_t *numel, const void **data);
GW_HIDDEN PyObject *gw_shim_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
GW_HIDDEN PyObject *gw_batch_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

#ifndef _WIN32
#define GW_NORM_WORKER 1
GW_HIDDEN PyObject *gw_norms_open(PyObject *self, PyObject *sizes);
GW_HIDDEN PyObject *gw_norms_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
GW_HIDDEN PyObject *gw_norms_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
GW_HIDDEN PyObject *gw_norms_close(PyObject *self, PyObject *cap);
#endif

#endif
