/* Token ids from a Python list (or tuple) to int32 little-endian bytes, the form kvfabric
 * hashes, sends and stores them in; and chunk keys to their packed wire form (one bytes of
 * keys back to back, protocol/messages.py).
 *
 * Why it exists: engines hand token ids over as Python lists. numpy converts a list at about
 * 20 M ids/s here (it probes each item's type for the general case) and struct.pack at 40 M,
 * while the chained xxh3 over the bytes runs at several hundred M; this loop reads each int
 * once (PyLong_AsLongAndOverflow), about 10x numpy. Items that are not ints but index like
 * one (numpy integers) go through __index__; anything else (a float, a str, a bool) is a TypeError,
 * and an id outside int32 an OverflowError: kvfabric/hashing.py turns both into SpecError.
 *
 * A lookup of a 512-chunk chain packs 512 keys in the client: checking each key's type and
 * length in Python cost about 20 us of such a round trip's ~250; join_keys takes 2. (The
 * daemon cuts them apart with numpy, about as fast as a loop here would.)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int store(PyObject *item, unsigned char *dst, Py_ssize_t index)
{
    int overflow = 0;
    long value;
    if (PyBool_Check(item)) {
        PyErr_Format(PyExc_TypeError, "token id %zd is not an integer: %R", index, item);
        return -1;
    }
    if (PyLong_Check(item)) {
        value = PyLong_AsLongAndOverflow(item, &overflow);
    } else {
        PyObject *number = PyNumber_Index(item);
        if (number == NULL) {
            PyErr_Format(PyExc_TypeError, "token id %zd is not an integer: %R", index, item);
            return -1;
        }
        value = PyLong_AsLongAndOverflow(number, &overflow);
        Py_DECREF(number);
    }
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (overflow || value < INT32_MIN || value > INT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "token id %zd does not fit in int32", index);
        return -1;
    }
    uint32_t bits = (uint32_t)(int32_t)value;
    dst[0] = (unsigned char)bits;
    dst[1] = (unsigned char)(bits >> 8);
    dst[2] = (unsigned char)(bits >> 16);
    dst[3] = (unsigned char)(bits >> 24);
    return 0;
}

static PyObject *pack_int32(PyObject *self, PyObject *arg)
{
    (void)self;
    if (!PyList_Check(arg) && !PyTuple_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "pack_int32 takes a list or a tuple of token ids");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "token ids");
    if (seq == NULL)
        return NULL;
    /* a list may change size while its items' __index__ runs: read the length once and
     * index through the fast-sequence API only while it still holds */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * 4);
    if (out == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PySequence_Fast_GET_SIZE(seq) != n) {
            PyErr_SetString(PyExc_RuntimeError, "token ids changed size while being packed");
            goto fail;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(item);
        int failed = store(item, dst + 4 * i, i);
        Py_DECREF(item);
        if (failed)
            goto fail;
    }
    Py_DECREF(seq);
    return out;
fail:
    Py_DECREF(seq);
    Py_DECREF(out);
    return NULL;
}

/* join_keys(keys, size): the bytes objects of the list or tuple `keys`, each `size` bytes long
 * (ValueError naming the first that is not; TypeError for one that is not bytes), back to
 * back. */
static PyObject *join_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "join_keys takes 2 arguments");
        return NULL;
    }
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred())
        return NULL;
    if (!PyList_Check(args[0]) && !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "join_keys takes a list or a tuple of keys");
        return NULL;
    }
    PyObject *seq = args[0]; /* items are bytes (checked): nothing runs Python code below */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (size <= 0 || n > PY_SSIZE_T_MAX / size) {
        PyErr_SetString(PyExc_ValueError, "bad key size");
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, n * size);
    if (out == NULL)
        return NULL;
    char *dst = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyBytes_CheckExact(key)) {
            PyErr_Format(PyExc_TypeError, "key %zd is not bytes: %.100R", i, key);
            Py_DECREF(out);
            return NULL;
        }
        if (PyBytes_GET_SIZE(key) != size) {
            PyErr_Format(PyExc_ValueError, "key %zd is %zd bytes, not %zd", i,
                         PyBytes_GET_SIZE(key), size);
            Py_DECREF(out);
            return NULL;
        }
        memcpy(dst + i * size, PyBytes_AS_STRING(key), (size_t)size);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"pack_int32", pack_int32, METH_O, "pack_int32(ids: list | tuple) -> bytes (int32-LE)"},
    {"join_keys", (PyCFunction)(void (*)(void))join_keys, METH_FASTCALL,
     "join_keys(keys: list | tuple, size) -> bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tokens", NULL, 0, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tokens(void) { return PyModule_Create(&module); }
