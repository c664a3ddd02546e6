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

/* The kept root members' spans (start, end) in the body, grown as needed, and their bytes in all. */
typedef struct {
    Py_ssize_t *at;
    Py_ssize_t count, cap, size;
} Members;

/* The member whose key is the klen bytes at `key` is one `drop` names (every duplicate goes). */
static int
dropped(PyObject *drop, const char *key, Py_ssize_t klen)
{
    for (Py_ssize_t d = 0; d < PyTuple_Size(drop); d++) {
        PyObject *name = PyTuple_GetItem(drop, d);
        if (PyBytes_Size(name) == klen && memcmp(PyBytes_AsString(name), key, klen) == 0)
            return 1;
    }
    return 0;
}

/* The member b[i:value_end] kept: 0, or -1 with MemoryError set. */
static int
keep(Members *m, Py_ssize_t i, Py_ssize_t value_end)
{
    if (m->count == m->cap) {
        Py_ssize_t *grown = PyMem_Realloc(m->at, sizeof(Py_ssize_t) * 2 * m->cap * 2);
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        m->at = grown;
        m->cap *= 2;
    }
    m->at[2 * m->count] = i;
    m->at[2 * m->count + 1] = value_end;
    m->count++;
    m->size += value_end - i;
    return 0;
}

/* The root object's members from its first (b[i], past the opening brace and whitespace), those `drop` does
   not name kept in `m`: the index past its closing brace; -1, the Python path's (an escaped key, or not an
   object as far as this scan can tell); -2, an error set. */
static Py_ssize_t
root_members(const char *b, Py_ssize_t n, Py_ssize_t i, PyObject *drop, Members *m)
{
    if (i < n && b[i] == '}')
        return i + 1;
    for (;;) {
        if (i >= n || b[i] != '"')
            return -1;
        Py_ssize_t key_end = skip_string(b, i, n);
        if (key_end < 0 || memchr(b + i + 1, '\\', key_end - i - 2) != NULL)
            return -1; /* an escaped key: the Python path decodes it */
        Py_ssize_t j = skip_ws(b, key_end, n);
        if (j >= n || b[j] != ':')
            return -1;
        j = skip_ws(b, j + 1, n);
        Py_ssize_t value_end = j < n ? skip_value(b, j, n) : -1;
        if (value_end < 0)
            return -1;
        if (!dropped(drop, b + i + 1, key_end - i - 2) && keep(m, i, value_end) < 0)
            return -2;
        i = skip_ws(b, value_end, n);
        if (i < n && b[i] == '}')
            return i + 1;
        if (i >= n || b[i] != ',')
            return -1;
        i = skip_ws(b, i + 1, n);
    }
}

/* The body with its root object's members replaced by the kept ones joined by commas, then a comma and `extra`
   when there is one; the bytes before the object (b[:start]) and after it (b[end:]) as they were. */
static PyObject *
joined(const char *b, Py_ssize_t n, Py_ssize_t start, Py_ssize_t end, const Members *m, PyObject *extra)
{
    Py_ssize_t lx = PyBytes_Size(extra);
    Py_ssize_t commas = (m->count > 0 ? m->count - 1 : 0) + (lx > 0 && m->count > 0 ? 1 : 0);
    PyObject *out = PyBytes_FromStringAndSize(NULL, start + 1 + m->size + commas + lx + 1 + (n - end));
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AsString(out);
    memcpy(p, b, start);
    p += start;
    *p++ = '{';
    for (Py_ssize_t k = 0; k < m->count; k++) {
        if (k)
            *p++ = ',';
        memcpy(p, b + m->at[2 * k], m->at[2 * k + 1] - m->at[2 * k]);
        p += m->at[2 * k + 1] - m->at[2 * k];
    }
    if (lx > 0) {
        if (m->count)
            *p++ = ',';
        memcpy(p, PyBytes_AsString(extra), lx);
        p += lx;
    }
    *p++ = '}';
    memcpy(p, b + end, n - end);
    return out;
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
    for (Py_ssize_t d = 0; d < PyTuple_Size(drop); d++) {
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
    Members m = {PyMem_Malloc(sizeof(Py_ssize_t) * 2 * 16), 0, 16, 0};
    if (m.at == NULL)
        return PyErr_NoMemory();
    Py_ssize_t end = root_members(b, n, skip_ws(b, start + 1, n), drop, &m);
    PyObject *out = end >= 0 ? joined(b, n, start, end, &m, extra) : NULL;
    PyMem_Free(m.at);
    if (end == -1)
        Py_RETURN_NONE; /* the Python path's */
    return out;
}
