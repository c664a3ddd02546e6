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

PyObject *
learn_splice(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *event, *out;
    Py_ssize_t start, end;
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
    Py_ssize_t at = -1, text = 0;
    for (size_t k = 0; k < sizeof(text_keys) / sizeof(text_keys[0]) && at < 0; k++) {
        Py_ssize_t lk = (Py_ssize_t)strlen(text_keys[k]);
        at = find_in(b, 6, start, text_keys[k], lk); /* after `data: ` (stream._JSON_AT) */
        text = at + lk;
    }
    if (at < 0)
        Py_RETURN_NONE;
    Py_ssize_t close = text; /* the text's closing quote: the first quote not escaped */
    for (;;) {
        const char *q = close < start ? memchr(b + close, '"', start - close) : NULL;
        if (q == NULL)
            Py_RETURN_NONE;
        close = q - b;
        Py_ssize_t k = close;
        while (k > text && b[k - 1] == '\\')
            k--;
        if ((close - k) % 2 == 0)
            break;
        close += 1;
    }
    if (memchr(b + end, '[', n - end) != NULL)
        Py_RETURN_NONE; /* the ids are found as the last list of the event */
    /* mid: null (strip), then the tail up to the chunk's closing brace and the nvext key (trio), or the tail */
    Py_ssize_t lt = n - end, kept = trio ? (lt > 3 ? lt - 3 : 0) : lt;
    Py_ssize_t lnull = strip ? 4 : 0, lids = trio ? (Py_ssize_t)strlen(NVEXT_IDS) : 0;
    Py_ssize_t lm = lnull + kept + lids;
    PyObject *mid = PyBytes_FromStringAndSize(NULL, lm);
    if (mid == NULL)
        return NULL;
    char *m = PyBytes_AsString(mid);
    memcpy(m, "null", lnull);
    memcpy(m + lnull, b + end, kept);
    memcpy(m + lnull + kept, NVEXT_IDS, lids);
    if (splice_locate(b, n, b, text, b + close, start - close, b + end, lt) != start
        || !renders(b, n, start, end, m, lm, strip, trio, PyBytes_AsString(out), PyBytes_Size(out))) {
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
    return Py_BuildValue("(y#y#y#NN)", b, text, b + close, start - close, b + end, lt, mid, finish_head);
}

