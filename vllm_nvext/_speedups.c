/* The compiled twin of `send.python_stream_send`: the `send` handed to vLLM for a
 * reshaped response. Until armed it hands every message to `general` (the ReshapingSend);
 * armed with a stream's `splice.Splice` it serves the mid-stream deltas the splice serves, with
 * the same checks (`Splice.locate`) and the same bytes (`Splice.render`), and `data: [DONE]` and the
 * usage chunk as they came (`send._is_usage`), the stream's closing empty message, and the finish chunk of
 * choice 0 when it was armed for one (`finish.finish_chunk`'s bytes, `finish_span` below), and returns
 * `downstream`'s awaitable. The pure-Python twin is the oracle: tests/unit/test_stream_send.py
 * runs both against the general path on every recorded stream and on hypothesis layouts.
 *
 * Built on the limited API (abi3, CPython >= 3.10): one wheel per platform serves every version.
 */
#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Py_XSETREF is not part of the limited API */
#define SET_REF(field, value) do { PyObject *old_ = (field); Py_INCREF(value); (field) = (value); Py_XDECREF(old_); } while (0)
/* the same for a new reference or NULL */
#define Py_XSETREF_(field, value) do { PyObject *old_ = (field); (field) = (value); Py_XDECREF(old_); } while (0)

#define NVEXT_IDS ",\"nvext\":{\"completion_token_ids\":"

static PyObject *s_type, *s_body, *s_more_body, *s_body_type, *s_clock, *s_finished;

typedef struct {
    PyObject_HEAD
    PyObject *general;    /* the ReshapingSend: everything the splice does not serve */
    PyObject *downstream; /* the server's send */
    PyObject *prefix, *head, *tail, *mid; /* bytes, as splice.Splice holds them */
    PyObject *on_ids;     /* None, or called with (event, start, end) for each delta served */
    PyObject *tally_add;  /* None (metrics off), or metrics.StreamTally.add */
    PyObject *root;       /* bytes: the root of a usage chunk that goes out as it came (empty: none does) */
    /* The finish chunk of choice 0 (finish.finish_chunk): NULL, or the armed splice's bytes before a finish
       reason; where `choices`' first element starts; what follows the ids in the chunk's nvext (the prompt's
       ids, the nvext's and chunk's ends); the choice's state (chunks._Choice), marked finished once served */
    PyObject *finish_head, *finish_end, *finish_state;
    Py_ssize_t finish_root;
    int armed, strip, trio;
    long long left;       /* the metrics countdown: the message at 1 is timed */
} StreamSend;

static int
StreamSend_traverse(StreamSend *self, visitproc visit, void *arg)
{
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(self->general);
    Py_VISIT(self->downstream);
    Py_VISIT(self->prefix);
    Py_VISIT(self->head);
    Py_VISIT(self->tail);
    Py_VISIT(self->mid);
    Py_VISIT(self->on_ids);
    Py_VISIT(self->tally_add);
    Py_VISIT(self->root);
    Py_VISIT(self->finish_head);
    Py_VISIT(self->finish_end);
    Py_VISIT(self->finish_state);
    return 0;
}

static int
StreamSend_clear(StreamSend *self)
{
    self->armed = 0;
    Py_CLEAR(self->general);
    Py_CLEAR(self->downstream);
    Py_CLEAR(self->prefix);
    Py_CLEAR(self->head);
    Py_CLEAR(self->tail);
    Py_CLEAR(self->mid);
    Py_CLEAR(self->on_ids);
    Py_CLEAR(self->tally_add);
    Py_CLEAR(self->root);
    Py_CLEAR(self->finish_head);
    Py_CLEAR(self->finish_end);
    Py_CLEAR(self->finish_state);
    return 0;
}

static void
StreamSend_dealloc(StreamSend *self)
{
    PyTypeObject *tp = Py_TYPE(self);
    PyObject_GC_UnTrack(self);
    StreamSend_clear(self);
    freefunc tp_free = (freefunc)PyType_GetSlot(tp, Py_tp_free);
    tp_free(self);
    Py_DECREF(tp);
}

static PyObject *
StreamSend_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *general, *downstream;
    static char *kwlist[] = {"general", "downstream", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO:StreamSend", kwlist, &general, &downstream))
        return NULL;
    allocfunc alloc = (allocfunc)PyType_GetSlot(type, Py_tp_alloc);
    StreamSend *self = (StreamSend *)alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(general);
    self->general = general;
    Py_INCREF(downstream);
    self->downstream = downstream;
    return (PyObject *)self;
}

static long long
clock_ns(void)
{
    PyObject *now = PyObject_CallObject(s_clock, NULL);
    if (now == NULL)
        return -1;
    long long ns = PyLong_AsLongLong(now);
    Py_DECREF(now);
    return ns;
}

/* The hex digit `c` in lowercase, or -1. */
static int
lower_hex(unsigned char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

/* `splice.kept_text`: the n bytes at t, one JSON string's bytes, are ones a decode and orjson's encode give
   back as they are: no raw byte below 0x20, no raw quote, valid UTF-8 (no surrogate, no overlong, nothing
   past U+10FFFF), every backslash the start of one of orjson's escapes (`\"` `\\` `\b` `\f` `\n` `\r` `\t`,
   `\u00xx` in lowercase for another byte below 0x20), read from the string's start: a backslash that ends the
   bytes starts no escape (the quote after it is escaped), so it is refused. */
static int
kept_text(const unsigned char *t, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    while (i < n) {
        unsigned char c = t[i];
        if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
            i++;
            continue;
        }
        if (c == '\\') {
            if (i + 1 >= n)
                return 0;
            unsigned char e = t[i + 1];
            if (e == '"' || e == '\\' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
                i += 2;
                continue;
            }
            if (e != 'u' || i + 5 >= n || t[i + 2] != '0' || t[i + 3] != '0')
                return 0;
            int hi = lower_hex(t[i + 4]), lo = lower_hex(t[i + 5]);
            if (hi < 0 || hi > 1 || lo < 0)
                return 0;
            int v = hi * 16 + lo;
            if (v == 0x08 || v == 0x09 || v == 0x0a || v == 0x0c || v == 0x0d)
                return 0;
            i += 6;
            continue;
        }
        if (c < 0x80)  /* a byte below 0x20 or a quote */
            return 0;
        Py_ssize_t len;
        unsigned char lo = 0x80, hi = 0xbf;  /* the bounds of the second byte */
        if (c >= 0xc2 && c <= 0xdf)
            len = 2;
        else if (c >= 0xe0 && c <= 0xef) {
            len = 3;
            if (c == 0xe0)
                lo = 0xa0;
            else if (c == 0xed)
                hi = 0x9f;
        }
        else if (c >= 0xf0 && c <= 0xf4) {
            len = 4;
            if (c == 0xf0)
                lo = 0x90;
            else if (c == 0xf4)
                hi = 0x8f;
        }
        else
            return 0;
        if (i + len > n || t[i + 1] < lo || t[i + 1] > hi)
            return 0;
        for (Py_ssize_t k = 2; k < len; k++)
            if (t[i + k] < 0x80 || t[i + k] > 0xbf)
                return 0;
        i += len;
    }
    return 1;
}

/* `Splice.locate` over a splice's parts: where the ids of a delta the splice serves start; -1 for any other event. */
static Py_ssize_t
splice_locate(const char *b, Py_ssize_t n, const char *prefix, Py_ssize_t lp, const char *head, Py_ssize_t lh,
              const char *tail, Py_ssize_t lt)
{
    if (n < lp + lh + lt + 2)
        return -1;
    if (memcmp(b, prefix, lp) != 0)
        return -1;
    if (memcmp(b + n - lt, tail, lt) != 0)
        return -1;
    Py_ssize_t end = n - lt;
    if (b[end - 1] != ']')
        return -1;
    /* the last `[` of the event (the tail holds none), with only digits and commas after it */
    Py_ssize_t start = end - 2;
    while (start >= 0 && ((b[start] >= '0' && b[start] <= '9') || b[start] == ','))
        start--;
    if (start < 0 || b[start] != '[')
        return -1;
    Py_ssize_t h = start - lh;
    if (h < lp || memcmp(b + h, head, lh) != 0)
        return -1;
    if (!kept_text((const unsigned char *)b + lp, h - lp))
        return -1;
    return start;
}

/* Where the ids of a delta the armed splice serves start; -1 for any other event. */
static Py_ssize_t
locate(StreamSend *self, const char *b, Py_ssize_t n)
{
    return splice_locate(b, n, PyBytes_AsString(self->prefix), PyBytes_Size(self->prefix),
                         PyBytes_AsString(self->head), PyBytes_Size(self->head), PyBytes_AsString(self->tail),
                         PyBytes_Size(self->tail));
}

/* The usage chunk `stream.StreamReshaper` forwards as it came: one whole event, the root, `]`, no
   `"choices":` after it. */
static int
is_usage(StreamSend *self, const char *b, Py_ssize_t n)
{
    Py_ssize_t lr = PyBytes_Size(self->root);
    if (lr == 0 || n < lr + 3 || b[lr] != ']' || memcmp(b, PyBytes_AsString(self->root), lr) != 0)
        return 0;
    const char *nl = memchr(b, '\n', n);
    if (nl == NULL || nl - b != n - 2 || b[n - 1] != '\n' || memchr(b, '\r', n) != NULL)
        return 0;
    for (Py_ssize_t i = lr; i + 10 <= n; i++) {
        const char *q = memchr(b + i, '"', n - i);
        if (q == NULL)
            break;
        i = q - b;
        if (i + 10 <= n && memcmp(q, "\"choices\":", 10) == 0)
            return 0;
    }
    return 1;
}

/* ------------------------------------------------------------------ the finish chunk: finish_span
 *
 * The compiled twin of `finish.finish_ids`: where the ids of choice 0's finish chunk sit, when the chunk is
 * one `finish.finish_chunk` serves (the armed splice's prefix, a kept text, the splice's bytes before the
 * finish reason, then only what `finish._FINISH_TAIL` matches, no key of that tail written twice or before
 * it). The Python twin is the oracle: tests/unit/test_stream_finish.py runs both on every recorded finish
 * chunk and on hypothesis layouts.
 */

#define FS_MAX_KEYS 64 /* a tail with more keys is refused (finish._key_twice refuses it too) */

/* The length of the name [a-z_]+ at b[i] when `":` follows it; 0 if none does. */
static Py_ssize_t
fs_name(const char *b, Py_ssize_t i, Py_ssize_t n)
{
    Py_ssize_t k = i;
    while (k < n && ((b[k] >= 'a' && b[k] <= 'z') || b[k] == '_'))
        k++;
    if (k == i || k + 2 > n || b[k] != '"' || b[k + 1] != ':')
        return 0;
    return k - i;
}

static int
fs_is(const char *b, Py_ssize_t at, Py_ssize_t len, const char *name)
{
    return (size_t)len == strlen(name) && memcmp(b + at, name, (size_t)len) == 0;
}

/* An id (0, or up to 15 digits without a leading zero: finish._ID) at b[i]: the index past it, or -1.
   The integers of the finish tail, of a list of ids and of a plain chunk are read by it. */
static Py_ssize_t
id_end(const char *b, Py_ssize_t i, Py_ssize_t n)
{
    Py_ssize_t first = i;
    if (i >= n)
        return -1;
    if (b[i] == '0')
        return i + 1;
    if (b[i] < '1' || b[i] > '9')
        return -1;
    while (i < n && b[i] >= '0' && b[i] <= '9')
        i++;
    return i - first <= 15 ? i : -1;
}

static Py_ssize_t pc_string(const char *b, Py_ssize_t i, Py_ssize_t n);

/* A kept member of the finish tail (finish._KEPT_KEY) at b[i]: `,"name":` and null under a key the general
   path neither reads nor writes, or a string of printable ASCII without escapes or an integer of at most 15
   digits under one it does not move either. The index past it (its name's place in *at, *len), or -1. */
static Py_ssize_t
fs_kept(const char *b, Py_ssize_t i, Py_ssize_t n, Py_ssize_t *at, Py_ssize_t *len)
{
    if (i + 2 > n || b[i] != ',' || b[i + 1] != '"')
        return -1;
    Py_ssize_t a = i + 2, l = fs_name(b, a, n);
    if (l == 0 || fs_is(b, a, l, "token_ids") || fs_is(b, a, l, "finish_reason") || fs_is(b, a, l, "choices")
        || fs_is(b, a, l, "nvext"))
        return -1;
    *at = a;
    *len = l;
    Py_ssize_t v = a + l + 2;
    if (v + 4 <= n && memcmp(b + v, "null", 4) == 0)
        return v + 4;
    if (v >= n || fs_is(b, a, l, "prompt_token_ids") || fs_is(b, a, l, "kv_transfer_params")
        || fs_is(b, a, l, "index"))
        return -1;
    if (b[v] == '"')
        return pc_string(b, v, n); /* printable ASCII without escapes, as a plain chunk's strings */
    if (b[v] == '-' && (++v >= n || b[v] == '0'))
        return -1; /* -0: orjson writes 0 */
    return id_end(b, v, n);
}

/* A list of ids (finish._ID: 0, or up to 15 digits without a leading zero) at b[i]: the index past it, or -1. */
static Py_ssize_t
fs_ids(const char *b, Py_ssize_t i, Py_ssize_t n)
{
    if (i >= n || b[i] != '[')
        return -1;
    i++;
    if (i < n && b[i] == ']')
        return i + 1;
    for (;;) {
        i = id_end(b, i, n);
        if (i < 0 || i >= n)
            return -1;
        if (b[i] == ']')
            return i + 1;
        if (b[i] != ',')
            return -1;
        i++;
    }
}

/* `finish.finish_ids`: 1 with the ids at b[*start:*end] when the finish chunk b is served, else 0. */
static int
finish_span(const char *b, Py_ssize_t n, const char *prefix, Py_ssize_t lp, const char *fh, Py_ssize_t lf,
            Py_ssize_t root_end, Py_ssize_t *start, Py_ssize_t *end)
{
    /* root_end comes from the caller, any Py_ssize_t: compared without the sum that could overflow */
    if (n < lp || memcmp(b, prefix, lp) != 0 || root_end < 0 || root_end > n - 11
        || memcmp(b + root_end, "{\"index\":0,", 11) != 0)
        return 0;
    /* the first quote: the text's end unless escaped (a text holding `\"`), which kept_text then refuses */
    const char *q = memchr(b + lp, '"', n - lp);
    if (q == NULL)
        return 0;
    Py_ssize_t close = q - b;
    if (close + lf > n || memcmp(b + close, fh, lf) != 0 || !kept_text((const unsigned char *)b + lp, close - lp))
        return 0;
    Py_ssize_t keys[2 * FS_MAX_KEYS]; /* each key's name: where it starts, its length */
    int count = 0;
    Py_ssize_t tail = close + lf, i = tail + 17;
    if (i > n || memcmp(b + tail, "\"finish_reason\":\"", 17) != 0)
        return 0;
    keys[count * 2] = tail + 1;
    keys[count * 2 + 1] = 13;
    count++;
    Py_ssize_t reason = i;
    while (i < n && ((b[i] >= 'a' && b[i] <= 'z') || b[i] == '_'))
        i++;
    if (i == reason || i >= n || b[i] != '"')
        return 0;
    i++;
    for (;;) { /* kept members, then the ids */
        if (i + 13 <= n && memcmp(b + i, ",\"token_ids\":", 13) == 0) {
            keys[count * 2] = i + 2;
            keys[count * 2 + 1] = 9;
            count++;
            i += 13;
            break;
        }
        Py_ssize_t at, len;
        i = fs_kept(b, i, n, &at, &len);
        if (i < 0 || count == FS_MAX_KEYS - 1)
            return 0;
        keys[count * 2] = at;
        keys[count * 2 + 1] = len;
        count++;
    }
    *start = i;
    i = fs_ids(b, i, n);
    if (i < 0)
        return 0;
    *end = i;
    for (int closed = 0;;) { /* kept members, the end of the choice and of `choices`, kept root members, the end */
        if (!closed && i + 2 <= n && b[i] == '}' && b[i + 1] == ']') {
            closed = 1;
            i += 2;
            continue;
        }
        if (closed && i + 3 == n && memcmp(b + i, "}\n\n", 3) == 0)
            break;
        Py_ssize_t at, len;
        i = fs_kept(b, i, n, &at, &len);
        if (i < 0 || count == FS_MAX_KEYS)
            return 0;
        keys[count * 2] = at;
        keys[count * 2 + 1] = len;
        count++;
    }
    for (int k = 0; k < count; k++) { /* finish._key_twice */
        const char *name = b + keys[2 * k];
        Py_ssize_t len = keys[2 * k + 1];
        for (int o = k + 1; o < count; o++)
            if (keys[2 * o + 1] == len && memcmp(b + keys[2 * o], name, len) == 0)
                return 0;
        for (Py_ssize_t p = 0; p + len + 3 <= tail; p++) { /* `"name":` before the tail */
            const char *r = memchr(b + p, '"', tail - len - 3 - p + 1);
            if (r == NULL)
                break;
            p = r - b;
            if (memcmp(r + 1, name, len) == 0 && r[len + 1] == '"' && r[len + 2] == ':')
                return 0;
        }
    }
    return 1;
}

static PyObject *
py_finish_ids(PyObject *module, PyObject *args)
{
    PyObject *event, *prefix, *finish_head;
    Py_ssize_t root_end, start, end;
    if (!PyArg_ParseTuple(args, "SSSn:finish_ids", &event, &prefix, &finish_head, &root_end))
        return NULL;
    if (!finish_span(PyBytes_AsString(event), PyBytes_Size(event), PyBytes_AsString(prefix), PyBytes_Size(prefix),
                     PyBytes_AsString(finish_head), PyBytes_Size(finish_head), root_end, &start, &end))
        Py_RETURN_NONE;
    return Py_BuildValue("(nn)", start, end);
}

static PyObject *
StreamSend_call(StreamSend *self, PyObject *args, PyObject *kwds)
{
    PyObject *message;
    if (!PyArg_UnpackTuple(args, "send", 1, 1, &message))
        return NULL;
    if (!self->armed || !PyDict_Check(message))
        goto general;
    PyObject *kind = PyDict_GetItemWithError(message, s_type);
    if (kind == NULL) {
        if (PyErr_Occurred())
            return NULL;
        goto general;
    }
    int is_body = PyObject_RichCompareBool(kind, s_body_type, Py_EQ);
    if (is_body < 0)
        return NULL;
    if (!is_body)
        goto general;
    PyObject *more = PyDict_GetItemWithError(message, s_more_body);
    if (more == NULL && PyErr_Occurred())
        return NULL;
    int truth = more == NULL ? 0 : PyObject_IsTrue(more);
    if (truth < 0)
        return NULL;
    PyObject *body = PyDict_GetItemWithError(message, s_body);
    if (body == NULL && PyErr_Occurred())
        return NULL;
    if (!truth) {
        /* the stream's closing message, empty: out as it came (nothing is held or waits while armed), not
           counted (the general path counts it as a framed message of no event) */
        if (body == NULL || (PyBytes_CheckExact(body) && PyBytes_Size(body) == 0))
            return PyObject_CallFunctionObjArgs(self->downstream, message, NULL);
        goto general;
    }
    if (body == NULL || !PyBytes_CheckExact(body))
        goto general;
    long long t0 = 0;
    if (self->left == 1 && self->tally_add != Py_None) {
        t0 = clock_ns();
        if (t0 < 0)
            return NULL;
    }
    const char *b = PyBytes_AsString(body);
    Py_ssize_t n = PyBytes_Size(body);
    Py_ssize_t start = locate(self, b, n);
    if (start < 0) {
        if ((n == 14 && memcmp(b, "data: [DONE]\n\n", 14) == 0) || is_usage(self, b, n))
            goto count; /* the end of the stream, the usage chunk: out as they came (nothing waits while armed) */
        Py_ssize_t fs, fe;
        if (self->finish_head == NULL
            || !finish_span(b, n, PyBytes_AsString(self->prefix), PyBytes_Size(self->prefix),
                            PyBytes_AsString(self->finish_head), PyBytes_Size(self->finish_head), self->finish_root,
                            &fs, &fe))
            goto general;
        /* the finish chunk of choice 0: what chunks.ChunkReshaper.finish_first_choice records, then its bytes */
        PyObject *fin_end = self->finish_end, *state = self->finish_state; /* held across the calls below */
        int strip = self->strip;
        Py_INCREF(body);
        Py_INCREF(fin_end);
        Py_INCREF(state);
        Py_CLEAR(self->finish_head); /* served once: a second finish chunk goes to the general path */
        int recorded = 1;
        if (self->on_ids != Py_None) {
            PyObject *r = PyObject_CallFunction(self->on_ids, "Onn", body, fs, fe);
            recorded = r != NULL;
            Py_XDECREF(r);
        }
        if (!recorded || PyObject_SetAttr(state, s_finished, Py_True) < 0) {
            PyErr_Clear(); /* the general path tries it again, and forwards it unchanged if it fails again */
            Py_DECREF(body);
            Py_DECREF(fin_end);
            Py_DECREF(state);
            goto general;
        }
        Py_DECREF(state);
        Py_ssize_t cut = strip ? fs : n - 3, kept = strip ? n - 3 - fe : 0;
        Py_ssize_t lk = sizeof(NVEXT_IDS) - 1, ids = fe - fs, le = PyBytes_Size(fin_end);
        PyObject *finished = PyBytes_FromStringAndSize(NULL, cut + (strip ? 4 : 0) + kept + lk + ids + le);
        if (finished == NULL) {
            Py_DECREF(body);
            Py_DECREF(fin_end);
            return NULL;
        }
        char *o = PyBytes_AsString(finished);
        memcpy(o, b, cut);
        o += cut;
        if (strip) {
            memcpy(o, "null", 4);
            memcpy(o + 4, b + fe, kept);
            o += 4 + kept;
        }
        memcpy(o, NVEXT_IDS, lk);
        memcpy(o + lk, b + fs, ids);
        memcpy(o + lk + ids, PyBytes_AsString(fin_end), le);
        Py_DECREF(body);
        Py_DECREF(fin_end);
        int unset = PyDict_SetItem(message, s_body, finished);
        Py_DECREF(finished);
        if (unset)
            return NULL;
        goto count;
    }
    Py_ssize_t end = n - PyBytes_Size(self->tail);
    /* The splice this delta matched, held across the call below (which could arm the send anew):
       the delta is served by the parts it was matched against. */
    PyObject *mid_bytes = self->mid;
    int strip = self->strip, trio = self->trio;
    Py_INCREF(body); /* the message's body is replaced below */
    Py_INCREF(mid_bytes);
    if (self->on_ids != Py_None) {
        PyObject *r = PyObject_CallFunction(self->on_ids, "Onn", body, start, end);
        if (r == NULL) {
            Py_DECREF(body);
            Py_DECREF(mid_bytes);
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return NULL;
            /* ids a decode refuses (send.python_stream_send): the general path forwards the delta unchanged and
               counts it, as it does without the armed send */
            PyErr_Clear();
            goto general;
        }
        Py_DECREF(r);
    }
    PyObject *out = NULL;
    const char *mid = PyBytes_AsString(mid_bytes);
    Py_ssize_t lm = PyBytes_Size(mid_bytes);
    if (trio) {
        Py_ssize_t cut = strip ? start : end, ids = end - start;
        out = PyBytes_FromStringAndSize(NULL, cut + lm + ids + 4);
        if (out != NULL) {
            char *o = PyBytes_AsString(out);
            memcpy(o, b, cut);
            memcpy(o + cut, mid, lm);
            memcpy(o + cut + lm, b + start, ids);
            memcpy(o + cut + lm + ids, "}}\n\n", 4);
        }
    }
    else if (strip) {
        out = PyBytes_FromStringAndSize(NULL, start + lm);
        if (out != NULL) {
            char *o = PyBytes_AsString(out);
            memcpy(o, b, start);
            memcpy(o + start, mid, lm);
        }
    }
    else {
        Py_INCREF(body);
        out = body; /* neither: the delta goes out as vLLM wrote it */
    }
    Py_DECREF(body);
    Py_DECREF(mid_bytes);
    if (out == NULL)
        return NULL;
    int failed = PyDict_SetItem(message, s_body, out);
    Py_DECREF(out);
    if (failed)
        return NULL;
count:
    if (t0) {
        long long t1 = clock_ns();
        if (t1 < 0)
            return NULL;
        PyObject *r = PyObject_CallFunction(self->tally_add, "L", t1 - t0);
        if (r == NULL)
            return NULL;
        self->left = PyLong_AsLongLong(r);
        Py_DECREF(r);
        if (self->left == -1 && PyErr_Occurred())
            return NULL;
    }
    else {
        self->left -= 1;
    }
    return PyObject_CallFunctionObjArgs(self->downstream, message, NULL);
general:
    return PyObject_CallFunctionObjArgs(self->general, message, NULL);
}

static PyObject *
StreamSend_arm(StreamSend *self, PyObject *args)
{
    PyObject *prefix, *head, *tail, *mid, *on_ids, *tally_add, *root, *finish;
    PyObject *finish_head = NULL, *finish_end = NULL, *finish_state = NULL;
    Py_ssize_t finish_root = 0;
    int strip, trio;
    long long left;
    if (!PyArg_ParseTuple(args, "LOSSSSppOSO:arm", &left, &tally_add, &prefix, &head, &tail, &mid, &strip, &trio,
                          &on_ids, &root, &finish))
        return NULL;
    if (finish != Py_None
        && !PyArg_ParseTuple(finish, "SnSO:arm's finish", &finish_head, &finish_root, &finish_end, &finish_state))
        return NULL;
    if (!PyBytes_CheckExact(prefix) || !PyBytes_CheckExact(head) || !PyBytes_CheckExact(tail)
        || !PyBytes_CheckExact(mid) || !PyBytes_CheckExact(root)) {
        PyErr_SetString(PyExc_TypeError, "arm: the splice's parts must be bytes");
        return NULL;
    }
    if (PyBytes_Size(prefix) < 1 || memchr(PyBytes_AsString(tail), '[', PyBytes_Size(tail)) != NULL) {
        PyErr_SetString(PyExc_ValueError, "arm: not a splice splice.Splice would make");
        return NULL;
    }
    SET_REF(self->prefix, prefix);
    SET_REF(self->head, head);
    SET_REF(self->tail, tail);
    SET_REF(self->mid, mid);
    SET_REF(self->on_ids, on_ids);
    SET_REF(self->tally_add, tally_add);
    SET_REF(self->root, root);
    Py_XINCREF(finish_head);
    Py_XSETREF_(self->finish_head, finish_head);
    Py_XINCREF(finish_end);
    Py_XSETREF_(self->finish_end, finish_end);
    Py_XINCREF(finish_state);
    Py_XSETREF_(self->finish_state, finish_state);
    self->finish_root = finish_root;
    self->strip = strip;
    self->trio = trio;
    self->left = left;
    self->armed = 1;
    Py_RETURN_NONE;
}

static PyObject *
StreamSend_disarm(StreamSend *self, PyObject *unused)
{
    self->armed = 0;
    Py_RETURN_NONE;
}

static PyObject *
StreamSend_countdown(StreamSend *self, PyObject *unused)
{
    return PyLong_FromLongLong(self->left);
}

static PyMethodDef StreamSend_methods[] = {
    {"arm", (PyCFunction)StreamSend_arm, METH_VARARGS,
     "arm(countdown, tally_add, prefix, head, tail, mid, strip, trio, on_ids, root, finish): serve the deltas of "
     "this splice (finish: None, or (finish_head, root_end, nvext_end, state) to serve choice 0's finish chunk)"},
    {"disarm", (PyCFunction)StreamSend_disarm, METH_NOARGS, "Hand every message to general again."},
    {"countdown", (PyCFunction)StreamSend_countdown, METH_NOARGS, "The metrics countdown while armed."},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot StreamSend_slots[] = {
    {Py_tp_doc, "StreamSend(general, downstream): the compiled send handed to vLLM for a reshaped response."},
    {Py_tp_new, StreamSend_new},
    {Py_tp_dealloc, StreamSend_dealloc},
    {Py_tp_traverse, StreamSend_traverse},
    {Py_tp_clear, StreamSend_clear},
    {Py_tp_call, StreamSend_call},
    {Py_tp_methods, StreamSend_methods},
    {0, NULL},
};

static PyType_Spec StreamSend_spec = {
    "vllm_nvext._speedups.StreamSend",
    sizeof(StreamSend),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    StreamSend_slots,
};


/* ------------------------------------------------------------------ arming: learn_splice
 *
 * The compiled twin of `splice.learn_splice`: the splice `splice._splice_parts` finds from the delta that
 * arms a stream (ids at event[start:end]), returned only if it locates that delta's ids at `start` and
 * renders `out` (what the byte-level path made of the delta) byte for byte. Same parts or None as the
 * Python twin, its oracle: tests/unit/test_stream_send.py runs both on every recorded stream's deltas, the
 * hypothesis layouts and texts with escapes.
 */

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

static PyObject *
learn_splice(PyObject *module, PyObject *args)
{
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

/* ------------------------------------------------------------------ the request side: splice_root
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

static PyObject *
splice_root(PyObject *module, PyObject *args)
{
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


/* ------------------------------------------------------------------ the stream side: plain_chunk
 *
 * Whether a `data: {...}\n\n` event is plain JSON that orjson writes back byte for byte (no
 * whitespace; strings of printable ASCII without escapes; integers of at most 15 digits, no
 * fraction or exponent; null, true, false; no key twice in an object; at most 16 levels), and
 * where the values the general path reads sit: root `choices` (how many elements, all objects),
 * `prompt_token_ids` and `nvext`; in the first choice `index`, `token_ids`, `prompt_token_ids`
 * and `finish_reason`. outbound/finish.py's `first_chunk` builds the general path's bytes from it;
 * tests/unit/test_stream_finish.py and the stream tests compare them with the general path.
 */

enum { PC_CHOICES, PC_NCHOICES, PC_ROOT_PROMPT, PC_NVEXT = PC_ROOT_PROMPT + 2, PC_INDEX = PC_NVEXT + 2,
       PC_IDS = PC_INDEX + 2, PC_PROMPT = PC_IDS + 2, PC_FINISH = PC_PROMPT + 2, PC_SIZE = PC_FINISH + 2 };
enum { LEVEL_OTHER, LEVEL_ROOT, LEVEL_CHOICE };
#define PC_MAX_KEYS 64
#define PC_MAX_DEPTH 16

static Py_ssize_t pc_value(const char *b, Py_ssize_t i, Py_ssize_t n, int depth, int level, Py_ssize_t *spans);

static Py_ssize_t
pc_string(const char *b, Py_ssize_t i, Py_ssize_t n)
{
    for (i++; i < n; i++) {
        unsigned char c = (unsigned char)b[i];
        if (c == '"')
            return i + 1;
        if (c < 0x20 || c > 0x7e || c == '\\')
            return -1;
    }
    return -1;
}

static Py_ssize_t
pc_number(const char *b, Py_ssize_t i, Py_ssize_t n)
{
    if (b[i] == '-')
        i++;
    if (i < n && b[i] == '0' && i > 0 && b[i - 1] == '-')
        return -1; /* -0: orjson writes 0 */
    i = id_end(b, i, n);
    if (i < 0)
        return -1;
    if (i < n && ((b[i] >= '0' && b[i] <= '9') || b[i] == '.' || b[i] == 'e' || b[i] == 'E'))
        return -1;
    return i;
}

static int
pc_key_is(const char *b, Py_ssize_t start, Py_ssize_t end, const char *name)
{
    size_t len = strlen(name);
    return (size_t)(end - start - 2) == len && memcmp(b + start + 1, name, len) == 0;
}

static Py_ssize_t
pc_object(const char *b, Py_ssize_t i, Py_ssize_t n, int depth, int level, Py_ssize_t *spans)
{
    Py_ssize_t keys[2 * PC_MAX_KEYS];
    int count = 0;
    i++;
    if (i < n && b[i] == '}')
        return i + 1;
    while (i < n) {
        if (b[i] != '"' || count == PC_MAX_KEYS)
            return -1;
        Py_ssize_t key_end = pc_string(b, i, n);
        if (key_end < 0 || key_end >= n || b[key_end] != ':')
            return -1;
        for (int k = 0; k < count; k++) {
            if (keys[2 * k + 1] - keys[2 * k] == key_end - i && memcmp(b + keys[2 * k], b + i, key_end - i) == 0)
                return -1; /* a key twice: a decode keeps one */
        }
        keys[2 * count] = i;
        keys[2 * count + 1] = key_end;
        count++;
        Py_ssize_t value = key_end + 1;
        if (value >= n)
            return -1;
        int slot = -1, inner = LEVEL_OTHER;
        if (level == LEVEL_ROOT) {
            if (pc_key_is(b, i, key_end, "choices"))
                slot = PC_CHOICES; /* its elements: see pc_value */
            else if (pc_key_is(b, i, key_end, "prompt_token_ids"))
                slot = PC_ROOT_PROMPT;
            else if (pc_key_is(b, i, key_end, "nvext"))
                slot = PC_NVEXT;
        }
        else if (level == LEVEL_CHOICE) {
            if (pc_key_is(b, i, key_end, "index"))
                slot = PC_INDEX;
            else if (pc_key_is(b, i, key_end, "token_ids"))
                slot = PC_IDS;
            else if (pc_key_is(b, i, key_end, "prompt_token_ids"))
                slot = PC_PROMPT;
            else if (pc_key_is(b, i, key_end, "finish_reason"))
                slot = PC_FINISH;
        }
        Py_ssize_t end;
        if (slot == PC_CHOICES) {
            if (b[value] != '[')
                return -1;
            end = pc_value(b, value, n, depth + 1, LEVEL_CHOICE, spans); /* counts its elements */
        }
        else
            end = pc_value(b, value, n, depth + 1, inner, spans);
        if (end < 0)
            return -1;
        if (slot >= 0 && slot != PC_CHOICES) {
            spans[slot] = value;
            spans[slot + 1] = end;
        }
        if (end >= n)
            return -1;
        if (b[end] == '}')
            return end + 1;
        if (b[end] != ',')
            return -1;
        i = end + 1;
    }
    return -1;
}

/* The index past the value at b[i] (-1: not plain); `level` LEVEL_CHOICE on an array: root `choices`. */
static Py_ssize_t
pc_value(const char *b, Py_ssize_t i, Py_ssize_t n, int depth, int level, Py_ssize_t *spans)
{
    if (i >= n || depth > PC_MAX_DEPTH)
        return -1;
    char c = b[i];
    if (c == '"')
        return pc_string(b, i, n);
    if (c == '{')
        return pc_object(b, i, n, depth, level, spans);
    if (c == '[') {
        int choices = level == LEVEL_CHOICE, element = 0;
        i++;
        if (i < n && b[i] == ']') {
            if (choices)
                spans[PC_NCHOICES] = 0;
            return i + 1;
        }
        while (i < n) {
            if (choices && b[i] != '{')
                return -1;
            Py_ssize_t end = pc_value(b, i, n, depth + 1, choices && element == 0 ? LEVEL_CHOICE : LEVEL_OTHER, spans);
            if (end < 0 || end >= n)
                return -1;
            element++;
            if (b[end] == ']') {
                if (choices)
                    spans[PC_NCHOICES] = element;
                return end + 1;
            }
            if (b[end] != ',')
                return -1;
            i = end + 1;
        }
        return -1;
    }
    if (c == '-' || (c >= '0' && c <= '9'))
        return pc_number(b, i, n);
    if (n - i >= 4 && (memcmp(b + i, "null", 4) == 0 || memcmp(b + i, "true", 4) == 0))
        return i + 4;
    if (n - i >= 5 && memcmp(b + i, "false", 5) == 0)
        return i + 5;
    return -1;
}

static PyObject *
plain_chunk(PyObject *module, PyObject *arg)
{
    if (!PyBytes_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "plain_chunk: the event must be bytes");
        return NULL;
    }
    const char *b = PyBytes_AsString(arg);
    Py_ssize_t n = PyBytes_Size(arg);
    Py_ssize_t spans[PC_SIZE];
    for (int k = 0; k < PC_SIZE; k++)
        spans[k] = -1;
    if (n < 10 || memcmp(b, "data: {", 7) != 0 || memcmp(b + n - 2, "\n\n", 2) != 0)
        Py_RETURN_NONE;
    if (pc_object(b, 6, n - 2, 0, LEVEL_ROOT, spans) != n - 2)
        Py_RETURN_NONE;
    PyObject *out = PyTuple_New(PC_SIZE - 1);
    if (out == NULL)
        return NULL;
    for (int k = 1; k < PC_SIZE; k++) {
        PyObject *v = PyLong_FromSsize_t(spans[k]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SetItem(out, k - 1, v);
    }
    return out;
}

static PyObject *
py_kept_text(PyObject *module, PyObject *arg)
{
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "bytes expected");
        return NULL;
    }
    return PyBool_FromLong(kept_text((const unsigned char *)PyBytes_AsString(arg), PyBytes_Size(arg)));
}

static PyMethodDef speedups_functions[] = {
    {"kept_text", py_kept_text, METH_O,
     "splice.kept_text over a whole bytes object: a text a splice serves (a decode writes it back as it is)."},
    {"splice_root", splice_root, METH_VARARGS,
     "splice_root(body, drop, extra): the body with the root members named in drop (bytes) left out and "
     "extra appended; None: the Python path decides"},
    {"learn_splice", learn_splice, METH_VARARGS,
     "learn_splice(event, start, end, strip, trio, out): (prefix, head, tail, mid, finish_head) of the splice "
     "the delta teaches, if it renders out; None: not armed"},
    {"finish_ids", py_finish_ids, METH_VARARGS,
     "finish_ids(event, prefix, finish_head, root_end): (start, end) of the ids of a finish chunk "
     "outbound/finish.py's finish_chunk serves; None: decode it"},
    {"plain_chunk", plain_chunk, METH_O,
     "plain_chunk(event): None, or the spans outbound/finish.py's first_chunk reads (see _speedups.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT, "vllm_nvext._speedups", "Compiled stream path of vllm_nvext (optional).", -1,
    speedups_functions,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    s_type = PyUnicode_InternFromString("type");
    s_body = PyUnicode_InternFromString("body");
    s_more_body = PyUnicode_InternFromString("more_body");
    s_body_type = PyUnicode_InternFromString("http.response.body");
    s_finished = PyUnicode_InternFromString("finished");
    if (!s_type || !s_body || !s_more_body || !s_body_type || !s_finished)
        return NULL;
    PyObject *time = PyImport_ImportModule("time");
    if (time == NULL)
        return NULL;
    s_clock = PyObject_GetAttrString(time, "perf_counter_ns");
    Py_DECREF(time);
    if (s_clock == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&speedups_module);
    if (m == NULL)
        return NULL;
    PyObject *type = PyType_FromSpec(&StreamSend_spec);
    if (type == NULL || PyModule_AddObject(m, "StreamSend", type) < 0) {
        Py_XDECREF(type);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
