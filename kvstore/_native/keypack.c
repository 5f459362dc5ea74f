/* Client keys from a Python sequence to what the hasher takes, in one pass of C.

   Why an extension of its own: cffi cannot take Python objects, and turning 1,000 keys into a
   checked list, their lengths and one concatenated buffer costs ~45 us in Python (type checks,
   map(len), join) next to ~70 us for hashing them; here it is a few microseconds. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* keys[i] must be a non-empty bytes (or subclass): otherwise set the error the API documents. */
static int check_key(PyObject *k, Py_ssize_t i) {
    if (!PyBytes_Check(k)) {
        PyErr_Format(PyExc_TypeError, "keys[%zd] must be bytes, got %s", i, Py_TYPE(k)->tp_name);
        return -1;
    }
    if (PyBytes_GET_SIZE(k) == 0) {
        PyErr_Format(PyExc_ValueError, "keys[%zd] is empty", i);
        return -1;
    }
    return 0;
}

/* check(keys) -> list: a new list of the keys, each checked. */
static PyObject *check(PyObject *self, PyObject *keys) {
    PyObject *list = PySequence_List(keys);
    if (!list) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (check_key(PyList_GET_ITEM(list, i), i) < 0) {
            Py_DECREF(list);
            return NULL;
        }
    }
    return list;
}

/* pack(keys) -> (blob, lens): the keys concatenated, and their lengths as little-endian u64. */
static PyObject *pack(PyObject *self, PyObject *keys) {
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (check_key(items[i], i) < 0) goto fail;
        total += PyBytes_GET_SIZE(items[i]);
    }
    PyObject *blob = PyBytes_FromStringAndSize(NULL, total);
    PyObject *lens = PyBytes_FromStringAndSize(NULL, 8 * n);
    if (!blob || !lens) {
        Py_XDECREF(blob);
        Py_XDECREF(lens);
        goto fail;
    }
    char *b = PyBytes_AS_STRING(blob);
    char *l = PyBytes_AS_STRING(lens);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = PyBytes_GET_SIZE(items[i]);
        uint64_t v = (uint64_t)len;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        v = __builtin_bswap64(v);
#endif
        memcpy(b, PyBytes_AS_STRING(items[i]), (size_t)len);
        memcpy(l + 8 * i, &v, 8);
        b += len;
    }
    Py_DECREF(seq);
    return Py_BuildValue("(NN)", blob, lens);
fail:
    Py_DECREF(seq);
    return NULL;
}

static PyMethodDef methods[] = {
    {"check", check, METH_O, "check(keys) -> list: the keys as a new list; TypeError/ValueError names the first bad one."},
    {"pack", pack, METH_O, "pack(keys) -> (blob, lens): keys concatenated, and their lengths as little-endian u64."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvstore._native._keypack", NULL, -1, methods};

PyMODINIT_FUNC PyInit__keypack(void) { return PyModule_Create(&module); }
