/* learn_splice: the splice the delta that arms a stream teaches.
 *
 * Python twin: `outbound.splice.learn_splice`
 * Oracle: tests/unit/test_stream_send.py
 *
 * The compiled twin of `splice.learn_splice`: the splice `splice._splice_parts` finds from the delta that
 * arms a stream (ids at event[start:end]), returned only if it locates that delta's ids at `start` and
 * renders `out` (what the byte-level path made of the delta) byte for byte. Same parts or None as the
 * Python twin, its oracle: tests/unit/test_stream_send.py runs both on every recorded stream's deltas, the
 * hypothesis layouts and texts with escapes.
 */
#include "speedups.h"

/* The texts a splice serves (splice._TEXT_KEYS), in the order they are looked for. */
static const char *const text_keys[] = {
    "\"delta\":{\"content\":\"", "\"delta\":{\"reasoning_content\":\"", "\"delta\":{\"reasoning\":\"", "\"text\":\"",
};

/* bytes.find(key, from, to): the first `key` wholly inside b[from:to]; -1 if none. */
static Py_ssize_t
find_in(const char *b, Py_ssize_t from, Py_ssize_t to, const char *key, Py_ssize_t lk)
{
    for (Py_ssize_t i = from; i + lk <= to; i++) {
        const char *q = memchr(b + i, key[0], to - lk + 1 - i);
        if (q == NULL)
            return -1;
        i = q - b;
        if (memcmp(q, key, lk) == 0)
            return i;
    }
    return -1;
}

#define FINISH_KEY "\"finish_reason\":"

/* `Splice.render(event, start) == out`, compared in place: the delta's client bytes are `out`. */
static int
renders(const char *b, Py_ssize_t n, Py_ssize_t start, Py_ssize_t end, const char *mid, Py_ssize_t lm, int strip,
        int trio, const char *o, Py_ssize_t lo)
{
    if (trio) {
        Py_ssize_t cut = strip ? start : end, ids = end - start;
        return lo == cut + lm + ids + 4 && memcmp(o, b, cut) == 0 && memcmp(o + cut, mid, lm) == 0
               && memcmp(o + cut + lm, b + start, ids) == 0 && memcmp(o + cut + lm + ids, "}}\n\n", 4) == 0;
    }
    if (strip)
        return lo == start + lm && memcmp(o, b, start) == 0 && memcmp(o + start, mid, lm) == 0;
    return lo == n && memcmp(o, b, n) == 0;
}

/* The delta's text before its ids (b[6:start]): where it starts (past its key, splice._TEXT_KEYS in order) and its
   closing quote (the first quote not escaped), into *text and *close: 1, or 0 when there is none. */
static int
text_span(const char *b, Py_ssize_t start, Py_ssize_t *text, Py_ssize_t *close)
{
    Py_ssize_t at = -1;
    for (size_t k = 0; k < sizeof(text_keys) / sizeof(text_keys[0]) && at < 0; k++) {
        Py_ssize_t lk = (Py_ssize_t)strlen(text_keys[k]);
        at = find_in(b, 6, start, text_keys[k], lk); /* after `data: ` (stream._JSON_AT) */
        *text = at + lk;
    }
    if (at < 0)
        return 0;
    Py_ssize_t c = *text;
    for (;;) {
        const char *q = c < start ? memchr(b + c, '"', start - c) : NULL;
        if (q == NULL)
            return 0;
        c = q - b;
        Py_ssize_t k = c;
        while (k > *text && b[k - 1] == '\\')
            k--;
        if ((c - k) % 2 == 0)
            break;
        c += 1;
    }
    *close = c;
    return 1;
}

/* The splice's `mid` for a delta whose ids end at b[end] (n bytes): null (strip), then the tail up to the chunk's
   closing brace and the nvext key (trio), or the tail. A new reference, or NULL with an exception set. */
static PyObject *
splice_mid(const char *b, Py_ssize_t n, Py_ssize_t end, int strip, int trio)
{
    Py_ssize_t lt = n - end, kept = trio ? (lt > 3 ? lt - 3 : 0) : lt;
    Py_ssize_t lnull = strip ? 4 : 0, lids = trio ? (Py_ssize_t)strlen(NVEXT_IDS) : 0;
    PyObject *mid = PyBytes_FromStringAndSize(NULL, lnull + kept + lids);
    if (mid == NULL)
        return NULL;
    char *m = PyBytes_AsString(mid);
    memcpy(m, "null", lnull);
    memcpy(m + lnull, b + end, kept);
    memcpy(m + lnull + kept, NVEXT_IDS, lids);
    return mid;
}

PyObject *
learn_splice(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *event, *out;
    Py_ssize_t start, end, text, close;
    int strip, trio;
    if (!PyArg_ParseTuple(args, "SnnppS:learn_splice", &event, &start, &end, &strip, &trio, &out))
        return NULL;
    if (!PyBytes_CheckExact(event) || !PyBytes_CheckExact(out)) {
        PyErr_SetString(PyExc_TypeError, "learn_splice: the event and its bytes must be bytes");
        return NULL;
    }
    const char *b = PyBytes_AsString(event);
    Py_ssize_t n = PyBytes_Size(event);
    if (start < 0 || start > end || end > n) {
        PyErr_SetString(PyExc_ValueError, "learn_splice: the ids must lie inside the event");
        return NULL;
    }
    if (!text_span(b, start, &text, &close) || memchr(b + end, '[', n - end) != NULL)
        Py_RETURN_NONE; /* no text a splice serves, or the ids are not the last list of the event */
    PyObject *mid = splice_mid(b, n, end, strip, trio);
    if (mid == NULL)
        return NULL;
    if (splice_locate(b, n, b, text, b + close, start - close, b + end, n - end) != start
        || !renders(b, n, start, end, PyBytes_AsString(mid), PyBytes_Size(mid), strip, trio, PyBytes_AsString(out),
                    PyBytes_Size(out))) {
        Py_DECREF(mid);
        Py_RETURN_NONE; /* not armed: the splice does not reproduce the delta */
    }
    Py_ssize_t fin = find_in(b, close, start, FINISH_KEY, (Py_ssize_t)strlen(FINISH_KEY));
    PyObject *finish_head = Py_None; /* the bytes before a finish reason (finish.finish_chunk); None: not known */
    if (fin < 0)
        Py_INCREF(Py_None);
    else if ((finish_head = PyBytes_FromStringAndSize(b + close, fin - close)) == NULL) {
        Py_DECREF(mid);
        return NULL;
    }
    return Py_BuildValue("(y#y#y#NN)", b, text, b + close, start - close, b + end, n - end, mid, finish_head);
}
