/* A tensor's dtype, device, size, contiguity and data pointer without Python attribute calls: torch's own C
 * functions (the AOTInductor shim that libtorch_cpu exports, aoti_torch_*), given the at::Tensor inside the
 * Python object.
 *
 * Why (docs/design.md, "Tensor facts through torch's C shim"; bench/README.md 1.19): before it reads a gradient the
 * native pass asks for its dtype, is_cpu, nbytes, is_contiguous() and data_ptr(): five Python attribute calls per
 * tensor, 0.1-0.2 us each with caches cold from backward -- on the tutorial MLP (24 tensors) most of the pass.
 * The shim's functions answer the same questions in a few ns each.
 *
 * Safety: nothing here is used until gw_shim_bind has
 *   1. found every function in the torch library this process has already loaded (dlopen RTLD_NOLOAD: never a
 *      second copy, never a library of another version);
 *   2. found the at::Tensor inside each probe object as the word equal to the TensorImpl address torch itself
 *      reports (Tensor._cdata), and found it right after the object header, for torch.Tensor and nn.Parameter
 *      alike: torch 2.13's `struct THPVariable { PyObject_HEAD; at::Tensor cdata; ... }`. Any other layout (older
 *      torch kept a c10::MaybeOwned<at::Tensor> there) leaves the attribute calls in place;
 * and native.py has compared the shim's answers with the attribute calls' on probes of every kind the passes
 * meet (contiguous or not, offset views, each dtype, empty, sparse, meta, a parameter, a gradient, a scalar),
 * unbinding it on any difference. The shim's functions catch torch's exceptions and answer an error code.
 */
#include "_native.h"
#include <stdint.h>

#ifdef GW_HAVE_SHIM
#include <dlfcn.h>
#include <stdbool.h>

typedef int32_t (*i32_fn)(void *, int32_t *);
typedef int32_t (*i64_fn)(void *, int64_t *);
typedef int32_t (*bool_fn)(void *, bool *);
typedef int32_t (*ptr_fn)(void *, void **);
typedef int32_t (*sizes_fn)(void *, int64_t **);
typedef int32_t (*code_fn)(void);

static struct {
    i32_fn device, layout, dtype;
    i64_fn numel, dim;
    sizes_fn sizes;
    bool_fn contiguous;
    ptr_fn data;
    int32_t cpu, strided, codes[4]; /* codes: float32, float64, int64, int32 (GW_F32 ...) */
} shim;
/* the at::Tensor's offset in the Python object: 0 while unbound (the attribute calls serve) */
static Py_ssize_t shim_off;

GW_HIDDEN int gw_shim_bound(void) {
    return shim_off != 0;
}

GW_HIDDEN int gw_shim_tensor(PyObject *t, int *kind, int64_t *numel, const void **data) {
    void *h = (char *)t + shim_off;
    int32_t v;
    int64_t n;
    bool c;
    void *p;
    if (shim.device(h, &v) || v != shim.cpu || shim.layout(h, &v) || v != shim.strided || shim.dtype(h, &v)) return 0;
    *kind = -1;
    for (int k = 0; k < 4; k++)
        if (v == shim.codes[k]) *kind = k;
    if (shim.numel(h, &n) || shim.contiguous(h, &c) || !c || shim.data(h, &p)) return 0;
    *numel = n;
    *data = p;
    return 1;
}

/* batch_key(inputs, targets) -> bytes | None: what the steady step caches a batch's layout by (its shape, dtype,
 * device and layout; the same key for the same tensors' kind, another for any difference), in one call instead of
 * six attribute calls and two tuples; None when the shim is not bound or one is neither None nor exactly a tensor
 * (then steady.py builds its key in Python). */
#define KEY_DIMS 12
GW_HIDDEN PyObject *gw_batch_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "batch_key(inputs, targets)");
        return NULL;
    }
    int64_t key[2 * (KEY_DIMS + 4)];
    Py_ssize_t n = 0;
    for (int b = 0; b < 2; b++) {
        PyObject *t = args[b];
        if (t == Py_None) {
            key[n++] = -1;
            continue;
        }
        if (!shim_off || !gw_is_tensor_type(t)) Py_RETURN_NONE;
        void *h = (char *)t + shim_off;
        int64_t dim, *sizes;
        int32_t dev, lay, dt;
        if (shim.dim(h, &dim) || dim < 0 || dim > KEY_DIMS || shim.sizes(h, &sizes) || shim.dtype(h, &dt)
            || shim.device(h, &dev) || shim.layout(h, &lay))
            Py_RETURN_NONE;
        key[n++] = dim;
        for (int64_t d = 0; d < dim; d++) key[n++] = sizes[d];
        key[n++] = dt;
        key[n++] = dev;
        key[n++] = lay;
    }
    return PyBytes_FromStringAndSize((const char *)key, n * (Py_ssize_t)sizeof key[0]);
}

static void *find(void *lib, const char *name, int *missing) {
    void *f = dlsym(lib, name);
    *missing |= f == NULL;
    return f;
}

/* shim_bind(library path or None, probes: tuple of tensors, their ._cdata: tuple of ints) -> str: "" when bound,
 * else why not (None unbinds). */
GW_HIDDEN PyObject *gw_shim_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    shim_off = 0;
    if (nargs != 3 || !PyTuple_CheckExact(args[1]) || !PyTuple_CheckExact(args[2])
        || PyTuple_GET_SIZE(args[1]) != PyTuple_GET_SIZE(args[2]) || !PyTuple_GET_SIZE(args[1])) {
        PyErr_SetString(PyExc_TypeError, "shim_bind(library path or None, probes: tuple, their _cdata: tuple)");
        return NULL;
    }
    if (args[0] == Py_None) return PyUnicode_FromString("unbound");
    const char *path = PyUnicode_AsUTF8(args[0]);
    if (!path) return NULL;
    void *lib = dlopen(path, RTLD_LAZY | RTLD_LOCAL | RTLD_NOLOAD);
    if (!lib) return PyUnicode_FromFormat("%s is not the loaded torch library", path);
    int missing = 0;
    shim.device = (i32_fn)find(lib, "aoti_torch_get_device_type", &missing);
    shim.layout = (i32_fn)find(lib, "aoti_torch_get_layout", &missing);
    shim.dtype = (i32_fn)find(lib, "aoti_torch_get_dtype", &missing);
    shim.numel = (i64_fn)find(lib, "aoti_torch_get_numel", &missing);
    shim.dim = (i64_fn)find(lib, "aoti_torch_get_dim", &missing);
    shim.sizes = (sizes_fn)find(lib, "aoti_torch_get_sizes", &missing);
    shim.contiguous = (bool_fn)find(lib, "aoti_torch_is_contiguous", &missing);
    shim.data = (ptr_fn)find(lib, "aoti_torch_get_data_ptr", &missing);
    static const char *codes[] = {"aoti_torch_dtype_float32", "aoti_torch_dtype_float64", "aoti_torch_dtype_int64",
                                  "aoti_torch_dtype_int32"};
    code_fn cpu = (code_fn)find(lib, "aoti_torch_device_type_cpu", &missing);
    code_fn strided = (code_fn)find(lib, "aoti_torch_layout_strided", &missing);
    code_fn dt[4];
    for (int k = 0; k < 4; k++) dt[k] = (code_fn)find(lib, codes[k], &missing);
    dlclose(lib); /* (RTLD_NOLOAD took a reference; torch's own keeps the library loaded) */
    if (missing) return PyUnicode_FromString("this torch lacks a function of the C shim");
    shim.cpu = cpu();
    shim.strided = strided();
    for (int k = 0; k < 4; k++) shim.codes[k] = dt[k]();
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[1]); i++) {
        PyObject *t = PyTuple_GET_ITEM(args[1], i);
        void *impl = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args[2], i));
        if (!impl) {
            PyErr_Clear();
            return PyUnicode_FromString("a probe's _cdata is not an address");
        }
        if (!gw_is_tensor_type(t)) return PyUnicode_FromString("a probe is not a torch.Tensor or nn.Parameter");
        /* the first word after the header must be the TensorImpl (an at::Tensor is one intrusive pointer) */
        if (Py_TYPE(t)->tp_basicsize < (Py_ssize_t)(sizeof(PyObject) + sizeof(void *))
            || *(void **)((char *)t + sizeof(PyObject)) != impl)
            return PyUnicode_FromString("torch.Tensor's object layout is not the one this build knows");
    }
    shim_off = sizeof(PyObject);
    return PyUnicode_FromString("");
}

#else /* no dlopen (Windows): the attribute calls serve */
GW_HIDDEN PyObject *gw_batch_key(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self, (void)args, (void)nargs;
    Py_RETURN_NONE;
}

GW_HIDDEN int gw_shim_bound(void) {
    return 0;
}

GW_HIDDEN int gw_shim_tensor(PyObject *t, int *kind, int64_t *numel, const void **data) {
    (void)t, (void)kind, (void)numel, (void)data;
    return 0;
}

GW_HIDDEN PyObject *gw_shim_bind(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self, (void)args, (void)nargs;
    return PyUnicode_FromString("no dlopen on this platform");
}
#endif
