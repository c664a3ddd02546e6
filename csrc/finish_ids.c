/* finish_ids: where the ids of choice 0's finish chunk sit.
 *
 * Python twin: `outbound.finish.finish_ids`; for the armed send (stream_send.c), the bytes
 *   `kernels._FinishChunk.served` writes (`finish_render`)
 * Oracle: tests/unit/test_stream_finish.py
 *
 * The compiled twin of `finish.finish_ids`: where the ids of choice 0's finish chunk sit, when the chunk is
 * one `finish.finish_chunk` serves (the armed splice's prefix, a kept text, the splice's bytes before the
 * finish reason, then only what `finish._FINISH_TAIL` matches, no key of that tail written twice or before
 * it). The Python twin is the oracle: tests/unit/test_stream_finish.py runs both on every recorded finish
 * chunk and on hypothesis layouts.
 */
#include "speedups.h"

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

/* The names of the finish tail's keys, in order: each one's place and length. */
typedef struct {
    Py_ssize_t at[2 * FS_MAX_KEYS];
    int count;
} Keys;

static void
add_key(Keys *keys, Py_ssize_t at, Py_ssize_t len)
{
    keys->at[2 * keys->count] = at;
    keys->at[2 * keys->count + 1] = len;
    keys->count++;
}

/* From the finish reason's key at b[tail] to the ids: the finish reason, kept members, `,"token_ids":`. The
   index where the ids' list starts, or -1. */
static Py_ssize_t
up_to_ids(const char *b, Py_ssize_t n, Py_ssize_t tail, Keys *keys)
{
    Py_ssize_t i = tail + 17;
    if (i > n || memcmp(b + tail, "\"finish_reason\":\"", 17) != 0)
        return -1;
    add_key(keys, tail + 1, 13);
    Py_ssize_t reason = i;
    while (i < n && ((b[i] >= 'a' && b[i] <= 'z') || b[i] == '_'))
        i++;
    if (i == reason || i >= n || b[i] != '"')
        return -1;
    i++;
    for (;;) { /* kept members, then the ids */
        if (i + 13 <= n && memcmp(b + i, ",\"token_ids\":", 13) == 0) {
            add_key(keys, i + 2, 9);
            return i + 13;
        }
        Py_ssize_t at, len;
        i = fs_kept(b, i, n, &at, &len);
        if (i < 0 || keys->count == FS_MAX_KEYS - 1)
            return -1;
        add_key(keys, at, len);
    }
}

/* From past the ids at b[i] to the chunk's end: kept members, the end of the choice and of `choices`, kept root
   members, `}\n\n`. 1, or 0. */
static int
after_ids(const char *b, Py_ssize_t n, Py_ssize_t i, Keys *keys)
{
    for (int closed = 0;;) {
        if (!closed && i + 2 <= n && b[i] == '}' && b[i + 1] == ']') {
            closed = 1;
            i += 2;
            continue;
        }
        if (closed && i + 3 == n && memcmp(b + i, "}\n\n", 3) == 0)
            return 1;
        Py_ssize_t at, len;
        i = fs_kept(b, i, n, &at, &len);
        if (i < 0 || keys->count == FS_MAX_KEYS)
            return 0;
        add_key(keys, at, len);
    }
}

/* finish._key_twice: a key of the tail written twice, or before it (`"name":` in b[:tail]). */
static int
key_twice(const char *b, const Keys *keys, Py_ssize_t tail)
{
    for (int k = 0; k < keys->count; k++) {
        const char *name = b + keys->at[2 * k];
        Py_ssize_t len = keys->at[2 * k + 1];
        for (int o = k + 1; o < keys->count; o++)
            if (keys->at[2 * o + 1] == len && memcmp(b + keys->at[2 * o], name, len) == 0)
                return 1;
        for (Py_ssize_t p = 0; p + len + 3 <= tail; p++) { /* `"name":` before the tail */
            const char *r = memchr(b + p, '"', tail - len - 3 - p + 1);
            if (r == NULL)
                break;
            p = r - b;
            if (memcmp(r + 1, name, len) == 0 && r[len + 1] == '"' && r[len + 2] == ':')
                return 1;
        }
    }
    return 0;
}

/* `finish.finish_ids`: 1 with the ids at b[*start:*end] when the finish chunk b is served, else 0. */
int
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
    Keys keys; /* each key's name: where it starts, its length */
    keys.count = 0;
    Py_ssize_t tail = close + lf, i = up_to_ids(b, n, tail, &keys);
    if (i < 0)
        return 0;
    *start = i;
    i = fs_ids(b, i, n);
    if (i < 0)
        return 0;
    *end = i;
    return after_ids(b, n, i, &keys) && !key_twice(b, &keys, tail);
}

PyObject *
py_finish_ids(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *event, *prefix, *finish_head;
    Py_ssize_t root_end, start, end;
    if (!PyArg_ParseTuple(args, "SSSn:finish_ids", &event, &prefix, &finish_head, &root_end))
        return NULL;
    if (!finish_span(PyBytes_AsString(event), PyBytes_Size(event), PyBytes_AsString(prefix), PyBytes_Size(prefix),
                     PyBytes_AsString(finish_head), PyBytes_Size(finish_head), root_end, &start, &end))
        Py_RETURN_NONE;
    return Py_BuildValue("(nn)", start, end);
}


/* `finish.finish_chunk`'s bytes for choice 0's finish chunk `body`, its ids at [fs:fe], with its `nvext` (bytes):
   vLLM's copy of the ids nulled (`strip`), the nvext member added at the chunk's end. A new reference, or NULL
   with an exception set. Python twin: the bytes `kernels._FinishChunk.served` writes. */
PyObject *
finish_render(PyObject *body, Py_ssize_t fs, Py_ssize_t fe, int strip, PyObject *nvext)
{
    const char *b = PyBytes_AsString(body);
    Py_ssize_t n = PyBytes_Size(body);
    Py_ssize_t cut = strip ? fs : n - 3, kept = strip ? n - 3 - fe : 0, lv = PyBytes_Size(nvext);
    PyObject *finished = PyBytes_FromStringAndSize(NULL, cut + (strip ? 4 : 0) + kept + 9 + lv + 3);
    if (finished == NULL)
        return NULL;
    char *o = PyBytes_AsString(finished);
    memcpy(o, b, cut);
    o += cut;
    if (strip) {
        memcpy(o, "null", 4);
        memcpy(o + 4, b + fe, kept);
        o += 4 + kept;
    }
    memcpy(o, ",\"nvext\":", 9);
    memcpy(o + 9, PyBytes_AsString(nvext), lv);
    memcpy(o + 9 + lv, "}\n\n", 3);
    return finished;
}
