/* splice_root: the request side's root splice.
 *
 * Python twin: `_json.splice_object` over a whole body (`inbound.rewrite.BodyRewrite.apply`)
 * Oracle: tests/unit/test_request_splice.py
 *
 * The compiled twin of `_json.splice_object` over a whole body (inbound.request.BodyRewrite.apply): the root
 * members named in `drop` go (every duplicate), `extra` (the added members, already encoded and
 * joined by commas) is appended, and every other byte stays as the client wrote it. The values are
 * skipped, never decoded: a string to its closing quote, an array or object to its matching bracket
 * (strings inside skipped), anything else to the next comma, bracket or whitespace. None hands the
 * body back to the Python path: a body that is not plain UTF-8 (a BOM, UTF-16, UTF-32), a key
 * spelled with an escape, or anything that is not a JSON object as far as this scan can tell.
 * The body is one the caller decoded already (valid JSON): tests/unit/test_request_splice.py
 * checks the bytes against `_json.splice_object` on generated bodies.
 */
#include "speedups.h"

static int
is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static Py_ssize_t
skip_ws(const char *b, Py_ssize_t i, Py_ssize_t n)
{
    while (i < n && is_ws(b[i]))
        i++;
    return i;
}

/* The index past the string whose opening quote is at b[i]; -1 if unterminated. */
static Py_ssize_t
skip_string(const char *b, Py_ssize_t i, Py_ssize_t n)
{
    i++;
    while (i < n) {
        const char *q = memchr(b + i, '"', n - i);
        if (q == NULL)
            return -1;
        Py_ssize_t j = q - b;
        /* an escaped quote has an odd run of backslashes before it */
        Py_ssize_t k = j - 1, run = 0;
        while (k >= i && b[k] == '\\') {
            run++;
            k--;
        }
        if (run % 2 == 0)
            return j + 1;
        i = j + 1;
    }
    return -1;
}

/* The index past the value starting at b[i]; -1 if it does not end inside the body. */
static Py_ssize_t
skip_value(const char *b, Py_ssize_t i, Py_ssize_t n)
{
    char c = b[i];
    if (c == '"')
        return skip_string(b, i, n);
    if (c == '[' || c == '{') {
        Py_ssize_t depth = 0;
        while (i < n) {
            c = b[i];
            if (c == '"') {
                i = skip_string(b, i, n);
                if (i < 0)
                    return -1;
                continue;
            }
            if (c == '[' || c == '{')
                depth++;
            else if (c == ']' || c == '}') {
                if (--depth == 0)
                    return i + 1;
            }
            i++;
        }
        return -1;
    }
    Py_ssize_t start = i;
    while (i < n && !is_ws(b[i]) && b[i] != ',' && b[i] != ':' && b[i] != ']' && b[i] != '}')
        i++;
    return i > start ? i : -1;
}

PyObject *
splice_root(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *body, *drop, *extra;
    if (!PyArg_ParseTuple(args, "SO!S:splice_root", &body, &PyTuple_Type, &drop, &extra))
        return NULL;
    const char *b = PyBytes_AsString(body);
    Py_ssize_t n = PyBytes_Size(body);
    Py_ssize_t ndrop = PyTuple_Size(drop);
    for (Py_ssize_t d = 0; d < ndrop; d++) {
        if (!PyBytes_CheckExact(PyTuple_GetItem(drop, d))) {
            PyErr_SetString(PyExc_TypeError, "splice_root: the keys to drop must be bytes");
            return NULL;
        }
    }
    /* json.detect_encoding: UTF-8 unless a BOM or a NUL in the first two bytes (a BOM is no JSON
       whitespace, so the object's brace test below also sends a UTF-8 BOM back) */
    if (n < 2 || b[0] == 0 || b[1] == 0)
        Py_RETURN_NONE;
    Py_ssize_t start = skip_ws(b, 0, n);
    if (start >= n || b[start] != '{')
        Py_RETURN_NONE;
    /* the kept members' spans (start, end), grown as needed */
    Py_ssize_t cap = 16, count = 0, size = 0;
    Py_ssize_t *spans = PyMem_Malloc(sizeof(Py_ssize_t) * 2 * cap);
    if (spans == NULL)
        return PyErr_NoMemory();
    Py_ssize_t i = skip_ws(b, start + 1, n), end = -1;
    if (i < n && b[i] == '}')
        end = i + 1;
    while (end < 0) {
        if (i >= n || b[i] != '"')
            goto fallback;
        Py_ssize_t key_end = skip_string(b, i, n);
        if (key_end < 0 || memchr(b + i + 1, '\\', key_end - i - 2) != NULL)
            goto fallback; /* an escaped key: the Python path decodes it */
        Py_ssize_t j = skip_ws(b, key_end, n);
        if (j >= n || b[j] != ':')
            goto fallback;
        j = skip_ws(b, j + 1, n);
        if (j >= n)
            goto fallback;
        Py_ssize_t value_end = skip_value(b, j, n);
        if (value_end < 0)
            goto fallback;
        int dropped = 0;
        Py_ssize_t klen = key_end - i - 2;
        for (Py_ssize_t d = 0; d < ndrop && !dropped; d++) {
            PyObject *name = PyTuple_GetItem(drop, d);
            dropped = PyBytes_Size(name) == klen && memcmp(PyBytes_AsString(name), b + i + 1, klen) == 0;
        }
        if (!dropped) {
            if (count == cap) {
                cap *= 2;
                Py_ssize_t *grown = PyMem_Realloc(spans, sizeof(Py_ssize_t) * 2 * cap);
                if (grown == NULL) {
                    PyMem_Free(spans);
                    return PyErr_NoMemory();
                }
                spans = grown;
            }
            spans[2 * count] = i;
            spans[2 * count + 1] = value_end;
            count++;
            size += value_end - i;
        }
        i = skip_ws(b, value_end, n);
        if (i < n && b[i] == '}')
            end = i + 1;
        else if (i < n && b[i] == ',')
            i = skip_ws(b, i + 1, n);
        else
            goto fallback;
    }
    Py_ssize_t lx = PyBytes_Size(extra);
    /* the kept members joined by commas, then a comma and extra when there is one */
    Py_ssize_t commas = (count > 0 ? count - 1 : 0) + (lx > 0 && count > 0 ? 1 : 0);
    Py_ssize_t total = start + 1 + size + commas + lx + 1 + (n - end);
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) {
        PyMem_Free(spans);
        return NULL;
    }
    char *p = PyBytes_AsString(out);
    memcpy(p, b, start);
    p += start;
    *p++ = '{';
    for (Py_ssize_t k = 0; k < count; k++) {
        if (k)
            *p++ = ',';
        memcpy(p, b + spans[2 * k], spans[2 * k + 1] - spans[2 * k]);
        p += spans[2 * k + 1] - spans[2 * k];
    }
    if (lx > 0) {
        if (count)
            *p++ = ',';
        memcpy(p, PyBytes_AsString(extra), lx);
        p += lx;
    }
    *p++ = '}';
    memcpy(p, b + end, n - end);
    p += n - end;
    PyMem_Free(spans);
    return out;
fallback:
    PyMem_Free(spans);
    Py_RETURN_NONE;
}


