/* Every sum the comparator needs from one chunk of two float32 arrays, in the single pass that
 * reads them.
 *
 * Why C: numpy has no ufunc that returns several reductions at once, so the numpy path
 * (metrics.py) makes seven passes per chunk (a - b, |d|, three dots, Σ|d|, max |d|). On two cores
 * that stopped near 0.8x of the raw read of the files, the arithmetic being as long as the read.
 * Fused, the pass is as long as reading the bytes. The numpy path stays: it is what runs where
 * this extension was not built (it is optional at install), and for float64.
 *
 * What this returns is what numpy's path computes, to float rounding: fp32 products summed in
 * fp32 lanes, flushed to float64 every block (so a 256K chunk's sums are *more* accurate than
 * a BLAS sdot over the whole chunk), and max |a - b| and max |b| exact. NaN and Inf are not
 * handled here: they show in the sums, and the caller then redoes the chunk in float64.
 *
 * The GIL is released for the loop: the comparator's threads run it side by side.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 16   /* independent accumulators: the compiler turns the lane loop into vectors */
#define BLOCK 2048 /* elements summed in fp32 lanes before they are added to float64 */

/* One build runs well on every x86-64: the loop is compiled for AVX-512, AVX2 and the baseline,
 * and the loader picks one for the CPU at hand (GNU ifunc). */
#if defined(__GNUC__) && defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define TD_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef TD_CLONES
#define TD_CLONES
#endif

typedef struct {
    double dd, aa, bb, ad; /* Σd², Σa², Σb², Σ|d|, d = a - b */
    float max_d, max_b;    /* max |d|, max |b| (a NaN never wins: it shows in the sums instead) */
} Sums;

TD_CLONES
static void sum_span(const float *x, const float *y, Py_ssize_t n, Sums *out) {
    double dd = 0, aa = 0, bb = 0, ad = 0;
    float max_d = 0, max_b = 0;
    float mx[LANES] = {0}, mb[LANES] = {0};
    Py_ssize_t i = 0;
    while (n - i >= LANES) {
        Py_ssize_t end = i + BLOCK < n ? i + BLOCK : n;
        float sdd[LANES] = {0}, saa[LANES] = {0}, sbb[LANES] = {0}, sad[LANES] = {0};
        for (; end - i >= LANES; i += LANES) {
            for (int k = 0; k < LANES; k++) {
                float a = x[i + k], b = y[i + k], d = a - b, abs_d = fabsf(d), abs_b = fabsf(b);
                sdd[k] += d * d;
                saa[k] += a * a;
                sbb[k] += b * b;
                sad[k] += abs_d;
                mx[k] = abs_d > mx[k] ? abs_d : mx[k];
                mb[k] = abs_b > mb[k] ? abs_b : mb[k];
            }
        }
        for (int k = 0; k < LANES; k++) {
            dd += sdd[k];
            aa += saa[k];
            bb += sbb[k];
            ad += sad[k];
        }
    }
    for (int k = 0; k < LANES; k++) {
        max_d = mx[k] > max_d ? mx[k] : max_d;
        max_b = mb[k] > max_b ? mb[k] : max_b;
    }
    for (; i < n; i++) {
        float a = x[i], b = y[i], d = a - b, abs_d = fabsf(d), abs_b = fabsf(b);
        dd += (double)(d * d);
        aa += (double)(a * a);
        bb += (double)(b * b);
        ad += abs_d;
        max_d = abs_d > max_d ? abs_d : max_d;
        max_b = abs_b > max_b ? abs_b : max_b;
    }
    out->dd = dd;
    out->aa = aa;
    out->bb = bb;
    out->ad = ad;
    out->max_d = max_d;
    out->max_b = max_b;
}

/* The chunk's sums, and with row_len > 0 each row's Σd² and Σa² + Σb² into row_dd / row_norm. */
static void sum_chunk(const float *x, const float *y, Py_ssize_t n, Py_ssize_t row_len, double *row_dd,
                      double *row_norm, Sums *out) {
    if (row_len == 0) {
        sum_span(x, y, n, out);
        return;
    }
    Sums total = {0, 0, 0, 0, 0, 0};
    for (Py_ssize_t r = 0; r * row_len < n; r++) {
        Sums row;
        sum_span(x + r * row_len, y + r * row_len, row_len, &row);
        row_dd[r] = row.dd;
        row_norm[r] = row.aa + row.bb;
        total.dd += row.dd;
        total.aa += row.aa;
        total.bb += row.bb;
        total.ad += row.ad;
        total.max_d = row.max_d > total.max_d ? row.max_d : total.max_d;
        total.max_b = row.max_b > total.max_b ? row.max_b : total.max_b;
    }
    *out = total;
}

#if PY_BIG_ENDIAN
#define NATIVE_ORDER '>'
#else
#define NATIVE_ORDER '<'
#endif

static int is_format(const Py_buffer *view, char code, Py_ssize_t itemsize) {
    const char *format = view->format ? view->format : "B";
    if (format[0] == '@' || format[0] == '=' || format[0] == NATIVE_ORDER)
        format++;
    return view->itemsize == itemsize && format[0] == code && format[1] == '\0';
}

static int get_array(PyObject *object, Py_buffer *view, char code, Py_ssize_t itemsize, int writable,
                     const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, view, flags) < 0)
        return -1;
    if (!is_format(view, code, itemsize)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a contiguous array of '%c' (%zd bytes each)", name, code,
                     itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(sums_doc,
             "sums(a, b, row_len=0, row_dd=None, row_norm=None)\n--\n\n"
             "(Σd², Σa², Σb², Σ|d|, max|d|, max|b|) of two float32 arrays, d = a - b, in one pass.\n"
             "With row_len > 0, also each row's Σd² into row_dd and Σa² + Σb² into row_norm\n"
             "(float64 arrays of len(a) // row_len).");

static PyObject *sums(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *a_obj, *b_obj, *dd_obj = Py_None, *norm_obj = Py_None;
    Py_ssize_t row_len = 0;
    if (!PyArg_ParseTuple(args, "OO|nOO:sums", &a_obj, &b_obj, &row_len, &dd_obj, &norm_obj))
        return NULL;
    Py_buffer a, b, row_dd = {0}, row_norm = {0};
    if (get_array(a_obj, &a, 'f', 4, 0, "a") < 0)
        return NULL;
    if (get_array(b_obj, &b, 'f', 4, 0, "b") < 0) {
        PyBuffer_Release(&a);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t n = a.len / 4;
    if ((uintptr_t)a.buf % sizeof(float) || (uintptr_t)b.buf % sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a and b must be aligned to 4 bytes");
        goto done;
    }
    if (b.len != a.len) {
        PyErr_Format(PyExc_ValueError, "a and b differ in length: %zd vs %zd", n, b.len / 4);
        goto done;
    }
    if (row_len < 0) {
        PyErr_Format(PyExc_ValueError, "row_len must be >= 0, not %zd", row_len);
        goto done;
    }
    if (row_len > 0 && n % row_len) {
        PyErr_Format(PyExc_ValueError, "row_len %zd does not divide the %zd elements", row_len, n);
        goto done;
    }
    if (row_len > 0) {
        if (get_array(dd_obj, &row_dd, 'd', 8, 1, "row_dd") < 0)
            goto done;
        if (get_array(norm_obj, &row_norm, 'd', 8, 1, "row_norm") < 0)
            goto done;
        if (row_dd.len / 8 != n / row_len || row_norm.len / 8 != n / row_len) {
            PyErr_Format(PyExc_ValueError, "row_dd and row_norm must hold %zd rows", n / row_len);
            goto done;
        }
    }
    Sums out;
    Py_BEGIN_ALLOW_THREADS
    sum_chunk((const float *)a.buf, (const float *)b.buf, n, row_len, (double *)row_dd.buf,
              (double *)row_norm.buf, &out);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(dddddd)", out.dd, out.aa, out.bb, out.ad, (double)out.max_d, (double)out.max_b);
done:
    if (row_norm.obj)
        PyBuffer_Release(&row_norm);
    if (row_dd.obj)
        PyBuffer_Release(&row_dd);
    PyBuffer_Release(&b);
    PyBuffer_Release(&a);
    return result;
}

/* The dump side's stats of one float32 array in the pass that reads it (tracedump/store/reduce.py):
 * Σx and Σ|x| in fp32 lanes flushed to float64 every block, min and max exact. torch's CPU path
 * takes four passes for the default stats (|x| written out, then Σ|x|, Σx, max): 5x the memory
 * traffic of this one. A NaN never wins min or max but shows in Σ|x|, as an Inf does: the caller
 * then lets torch's reductions say what they are. */
TD_CLONES
static void stat_span(const float *x, Py_ssize_t n, double *sum, double *abs_sum, float *lo, float *hi) {
    double s = 0, a = 0;
    float mn[LANES], mx[LANES];
    for (int k = 0; k < LANES; k++) {
        mn[k] = INFINITY;
        mx[k] = -INFINITY;
    }
    Py_ssize_t i = 0;
    while (n - i >= LANES) {
        Py_ssize_t end = i + BLOCK < n ? i + BLOCK : n;
        float ss[LANES] = {0}, sa[LANES] = {0};
        for (; end - i >= LANES; i += LANES) {
            for (int k = 0; k < LANES; k++) {
                float v = x[i + k];
                ss[k] += v;
                sa[k] += fabsf(v);
                mn[k] = v < mn[k] ? v : mn[k];
                mx[k] = v > mx[k] ? v : mx[k];
            }
        }
        for (int k = 0; k < LANES; k++) {
            s += ss[k];
            a += sa[k];
        }
    }
    float low = INFINITY, high = -INFINITY;
    for (int k = 0; k < LANES; k++) {
        low = mn[k] < low ? mn[k] : low;
        high = mx[k] > high ? mx[k] : high;
    }
    for (; i < n; i++) {
        float v = x[i];
        s += v;
        a += fabsf(v);
        low = v < low ? v : low;
        high = v > high ? v : high;
    }
    *sum = s;
    *abs_sum = a;
    *lo = low;
    *hi = high;
}

PyDoc_STRVAR(stats_doc, "stats(a) -> (sum, abs_sum, min, max) of a float32 buffer, in one pass (GIL released).");

static PyObject *stats(PyObject *self, PyObject *arg) {
    (void)self;
    Py_buffer a;
    if (get_array(arg, &a, 'f', 4, 0, "a") < 0)
        return NULL;
    PyObject *result = NULL;
    if ((uintptr_t)a.buf % sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "a must be aligned to 4 bytes");
    } else {
        double sum, abs_sum;
        float lo, hi;
        Py_BEGIN_ALLOW_THREADS
        stat_span((const float *)a.buf, a.len / 4, &sum, &abs_sum, &lo, &hi);
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("(dddd)", sum, abs_sum, (double)lo, (double)hi);
    }
    PyBuffer_Release(&a);
    return result;
}

static PyMethodDef methods[] = {
    {"sums", sums, METH_VARARGS, sums_doc},
    {"stats", stats, METH_O, stats_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kernel", "One-pass sums over float32 arrays: the comparator's chunks, the dump side's stats.", -1, methods, NULL, NULL,
    NULL, NULL,
};

PyMODINIT_FUNC PyInit_kernel(void) {
    PyObject *m = PyModule_Create(&module);
#ifdef Py_GIL_DISABLED
    if (m != NULL) /* no shared state: free-threaded builds keep the GIL off when importing it */
        PyUnstable_Module_SetGIL(m, Py_MOD_GIL_NOT_USED);
#endif
    return m;
}
