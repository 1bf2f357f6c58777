/* Strided 3-D copies of 2-byte and 4-byte elements (bit moves, no conversion).
 *
 * copy(dst, src, itemsize, n0, n1, n2, d0, d1, d2, s0, s1, s2): for a < n0, b < n1, c < n2,
 *     dst[a*d0 + b*d1 + c*d2] = src[a*s0 + b*s1 + c*s2]
 * with addresses as integers and strides in elements. The only caller,
 * kvfabric/memory/strided.py, checks that every address lies inside the tensors it was given,
 * that dst does not overlap itself and that dst and src do not overlap.
 *
 * Why it exists: torch and numpy copy a transposed view (unit stride along different dims on
 * the two sides) one element at a time, ~4 GB/s here. That case runs here in 8x8 (16-bit) or
 * 4x4 (32-bit) SSE2 register tiles inside 64x64 cache tiles; wider vectors measured no faster
 * (the copy is bound by memory, not by shuffles). Rows contiguous on both sides are memcpy'd;
 * anything else takes a plain element loop. SSE2 is part of x86-64, so no CPU dispatch is
 * needed; other targets take the element loop for transposes too.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Elements per side of a cache tile: 64x64 4-byte elements are 16 KiB a side, in L1. Other
 * shapes (128x32, 256x16, ...) measured the same here. */
#define TILE 64

/* One matrix: dst[i*dst_row + j] = src[j*src_row + i] for i < rows, j < cols. */
typedef struct {
    Py_ssize_t rows, cols, src_row, dst_row;
} Matrix;

#if defined(__SSE2__)
/* An 8x8 tile of 16-bit elements: dst rows i..i+7 from src rows j..j+7. */
static inline void tile16(const uint16_t *s, Py_ssize_t src_row, uint16_t *d, Py_ssize_t dst_row)
{
    __m128i r[8], a[8], b[8];
    for (int k = 0; k < 8; k++)
        r[k] = _mm_loadu_si128((const __m128i *)(s + k * src_row));
    for (int k = 0; k < 4; k++) {
        a[2 * k] = _mm_unpacklo_epi16(r[2 * k], r[2 * k + 1]);
        a[2 * k + 1] = _mm_unpackhi_epi16(r[2 * k], r[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {
        b[4 * k] = _mm_unpacklo_epi32(a[4 * k], a[4 * k + 2]);
        b[4 * k + 1] = _mm_unpackhi_epi32(a[4 * k], a[4 * k + 2]);
        b[4 * k + 2] = _mm_unpacklo_epi32(a[4 * k + 1], a[4 * k + 3]);
        b[4 * k + 3] = _mm_unpackhi_epi32(a[4 * k + 1], a[4 * k + 3]);
    }
    for (int k = 0; k < 4; k++) {
        __m128i lo = _mm_unpacklo_epi64(b[k], b[k + 4]), hi = _mm_unpackhi_epi64(b[k], b[k + 4]);
        _mm_storeu_si128((__m128i *)(d + 2 * k * dst_row), lo);
        _mm_storeu_si128((__m128i *)(d + (2 * k + 1) * dst_row), hi);
    }
}

/* A 4x4 tile of 32-bit elements. */
static inline void tile32(const uint32_t *s, Py_ssize_t src_row, uint32_t *d, Py_ssize_t dst_row)
{
    __m128i r0 = _mm_loadu_si128((const __m128i *)s);
    __m128i r1 = _mm_loadu_si128((const __m128i *)(s + src_row));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(s + 2 * src_row));
    __m128i r3 = _mm_loadu_si128((const __m128i *)(s + 3 * src_row));
    __m128i t0 = _mm_unpacklo_epi32(r0, r1), t1 = _mm_unpackhi_epi32(r0, r1);
    __m128i t2 = _mm_unpacklo_epi32(r2, r3), t3 = _mm_unpackhi_epi32(r2, r3);
    _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(d + dst_row), _mm_unpackhi_epi64(t0, t2));
    _mm_storeu_si128((__m128i *)(d + 2 * dst_row), _mm_unpacklo_epi64(t1, t3));
    _mm_storeu_si128((__m128i *)(d + 3 * dst_row), _mm_unpackhi_epi64(t1, t3));
}
#define TILE16(s, sr, d, dr) tile16(s, sr, d, dr)
#define TILE32(s, sr, d, dr) tile32(s, sr, d, dr)
#define W16 8
#define W32 4
#else
#define TILE16(s, sr, d, dr) ((void)0)
#define TILE32(s, sr, d, dr) ((void)0)
#define W16 0
#define W32 0
#endif

/* transpose16 / transpose32: one Matrix, W x W register tiles (W == 0: element loop only). */
#define DEFINE_TRANSPOSE(NAME, T, W, TILE_FN)                                                      \
    static void NAME(const T *src, T *dst, const Matrix *m)                                        \
    {                                                                                              \
        for (Py_ssize_t i0 = 0; i0 < m->rows; i0 += TILE) {                                        \
            Py_ssize_t i1 = i0 + TILE < m->rows ? i0 + TILE : m->rows;                             \
            for (Py_ssize_t j0 = 0; j0 < m->cols; j0 += TILE) {                                    \
                Py_ssize_t j1 = j0 + TILE < m->cols ? j0 + TILE : m->cols;                         \
                Py_ssize_t i = i0, j;                                                              \
                for (; W && i + W <= i1; i += W) {                                                 \
                    for (j = j0; j + W <= j1; j += W)                                              \
                        TILE_FN(src + j * m->src_row + i, m->src_row, dst + i * m->dst_row + j,    \
                                m->dst_row);                                                       \
                    for (; j < j1; j++) /* right edge, W rows at a time */                         \
                        for (Py_ssize_t k = i; k < i + W; k++)                                     \
                            dst[k * m->dst_row + j] = src[j * m->src_row + k];                     \
                }                                                                                  \
                for (; i < i1; i++) /* bottom edge */                                              \
                    for (j = j0; j < j1; j++)                                                      \
                        dst[i * m->dst_row + j] = src[j * m->src_row + i];                         \
            }                                                                                      \
        }                                                                                          \
    }

DEFINE_TRANSPOSE(transpose16, uint16_t, W16, TILE16)
DEFINE_TRANSPOSE(transpose32, uint32_t, W32, TILE32)

/* Any strides, element by element. */
#define DEFINE_ELEMENTS(NAME, T)                                                                   \
    static void NAME(const T *src, T *dst, const Py_ssize_t *n, const Py_ssize_t *ds,              \
                     const Py_ssize_t *ss)                                                         \
    {                                                                                              \
        for (Py_ssize_t a = 0; a < n[0]; a++)                                                      \
            for (Py_ssize_t b = 0; b < n[1]; b++)                                                  \
                for (Py_ssize_t c = 0; c < n[2]; c++)                                              \
                    dst[a * ds[0] + b * ds[1] + c * ds[2]] =                              \
                        src[a * ss[0] + b * ss[1] + c * ss[2]];                                    \
    }

DEFINE_ELEMENTS(elements16, uint16_t)
DEFINE_ELEMENTS(elements32, uint32_t)

static void copy3d(const char *src, char *dst, Py_ssize_t size, const Py_ssize_t *n,
                   const Py_ssize_t *ds, const Py_ssize_t *ss)
{
    if (ds[2] == 1 && ss[2] == 1 && ds[1] == n[2] && ss[1] == n[2]) { /* blocks contiguous */
        for (Py_ssize_t a = 0; a < n[0]; a++)
            memcpy(dst + a * ds[0] * size, src + a * ss[0] * size, (size_t)(n[1] * n[2] * size));
        return;
    }
    if (ds[2] == 1 && ss[2] == 1) { /* rows contiguous on both sides */
        for (Py_ssize_t a = 0; a < n[0]; a++)
            for (Py_ssize_t b = 0; b < n[1]; b++)
                memcpy(dst + (a * ds[0] + b * ds[1]) * size, src + (a * ss[0] + b * ss[1]) * size,
                       (size_t)(n[2] * size));
        return;
    }
    if (ds[2] == 1 && ss[1] == 1) { /* transposed: dst rows are src columns */
        Matrix m = {n[1], n[2], ss[2], ds[1]};
        for (Py_ssize_t a = 0; a < n[0]; a++) {
            const char *s = src + a * ss[0] * size;
            char *d = dst + a * ds[0] * size;
            if (size == 2)
                transpose16((const uint16_t *)s, (uint16_t *)d, &m);
            else
                transpose32((const uint32_t *)s, (uint32_t *)d, &m);
        }
        return;
    }
    if (ds[1] == 1 && ss[2] == 1) { /* transposed the other way: swap the inner dims */
        Py_ssize_t shape[3] = {n[0], n[2], n[1]};
        Py_ssize_t dst_strides[3] = {ds[0], ds[2], ds[1]}, src_strides[3] = {ss[0], ss[2], ss[1]};
        copy3d(src, dst, size, shape, dst_strides, src_strides); /* takes the branch above */
        return;
    }
    if (size == 2)
        elements16((const uint16_t *)src, (uint16_t *)dst, n, ds, ss);
    else
        elements32((const uint32_t *)src, (uint32_t *)dst, n, ds, ss);
}

static PyObject *copy(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t v[12];
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "copy takes 12 integer arguments");
        return NULL;
    }
    for (int k = 0; k < 12; k++) {
        v[k] = PyLong_AsSsize_t(args[k]);
        if (v[k] == -1 && PyErr_Occurred())
            return NULL;
    }
    if (v[2] != 2 && v[2] != 4) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be 2 or 4");
        return NULL;
    }
    for (int k = 3; k < 12; k++)
        if (v[k] < 0) {
            PyErr_SetString(PyExc_ValueError, "shape and strides must be non-negative");
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    copy3d((const char *)v[1], (char *)v[0], v[2], v + 3, v + 6, v + 9);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* gather_runs(into, pieces, first, outer, outer_stride, inner, inner_stride, length): the
 * runs of `length` bytes at first + a*outer_stride + b*inner_stride (a < outer, b < inner) of
 * the concatenation of the byte buffers `pieces`, back to back into the writable buffer
 * `into`. Every run must lie within the pieces and `into` must hold them all, else
 * ValueError before anything is copied. */
static PyObject *gather_runs(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_ssize_t v[6];
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "gather_runs takes 8 arguments");
        return NULL;
    }
    for (int k = 0; k < 6; k++) {
        v[k] = PyLong_AsSsize_t(args[k + 2]);
        if (v[k] == -1 && PyErr_Occurred())
            return NULL;
        if (v[k] < 0) {
            PyErr_SetString(PyExc_ValueError, "offsets, counts and strides must be non-negative");
            return NULL;
        }
    }
    Py_ssize_t first = v[0], outer = v[1], outer_stride = v[2], inner = v[3];
    Py_ssize_t inner_stride = v[4], length = v[5];
    PyObject *seq = PySequence_Fast(args[1], "pieces must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(count + 1, sizeof(Py_buffer));
    Py_ssize_t acquired = 0, total = 0;
    PyObject *result = NULL;
    if (views == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyObject_GetBuffer(args[0], &views[count], PyBUF_WRITABLE) < 0)
        goto done;
    for (; acquired < count; acquired++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, acquired), &views[acquired],
                               PyBUF_SIMPLE) < 0)
            goto done;
        total += views[acquired].len;
    }
    if (outer && inner && length) {
        Py_ssize_t last = first + (outer - 1) * outer_stride + (inner - 1) * inner_stride;
        if (last + length > total || outer * inner * length > views[count].len) {
            PyErr_SetString(PyExc_ValueError, "a run lies outside the pieces or the destination");
            goto done;
        }
        char *to = views[count].buf;
        Py_BEGIN_ALLOW_THREADS
        Py_ssize_t index = 0, piece_start = 0; /* the piece holding `position` */
        for (Py_ssize_t a = 0; a < outer; a++)
            for (Py_ssize_t b = 0; b < inner; b++) {
                Py_ssize_t position = first + a * outer_stride + b * inner_stride;
                Py_ssize_t remaining = length;
                if (position < piece_start) /* runs go backwards: search from the start */
                    index = 0, piece_start = 0;
                while (remaining) {
                    while (position >= piece_start + views[index].len)
                        piece_start += views[index++].len;
                    Py_ssize_t inside = position - piece_start;
                    Py_ssize_t n = views[index].len - inside;
                    if (n > remaining)
                        n = remaining;
                    memcpy(to, (const char *)views[index].buf + inside, (size_t)n);
                    to += n;
                    position += n;
                    remaining -= n;
                }
            }
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    if (views != NULL) {
        for (Py_ssize_t k = 0; k < acquired; k++)
            PyBuffer_Release(&views[k]);
        if (views[count].obj != NULL)
            PyBuffer_Release(&views[count]);
        PyMem_Free(views);
    }
    Py_DECREF(seq);
    return result;
}

static PyMethodDef methods[] = {
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL,
     "copy(dst, src, itemsize, n0, n1, n2, d0, d1, d2, s0, s1, s2)"},
    {"gather_runs", (PyCFunction)(void (*)(void))gather_runs, METH_FASTCALL,
     "gather_runs(into, pieces, first, outer, outer_stride, inner, inner_stride, length)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_strided", NULL, 0, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__strided(void) { return PyModule_Create(&module); }
