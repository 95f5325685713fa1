/* What the parts of gradwatch.publisher._native share (_native.c: the passes; _native_norms.c: the norm worker). */
#ifndef GRADWATCH_NATIVE_H
#define GRADWATCH_NATIVE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

#ifndef _WIN32
#define GW_NORM_WORKER 1
GW_HIDDEN PyObject *gw_norms_open(PyObject *self, PyObject *sizes);
GW_HIDDEN PyObject *gw_norms_post(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
GW_HIDDEN PyObject *gw_norms_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
GW_HIDDEN PyObject *gw_norms_close(PyObject *self, PyObject *cap);
#endif

#endif
