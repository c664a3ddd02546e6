/* The checks of an armed splice (a kept text, where a delta's ids start) and the bytes it writes.
 *
 * Python twin: `outbound.splice.kept_text` (`kept_text`) and `outbound.splice.Splice.locate` (`splice_locate`);
 *   for the armed send (stream_send.c): the delta branch of `kernels.python_stream_send` (`splice_render`) and
 *   `kernels._is_usage` (`usage_as_it_came`)
 * Oracle: tests/unit/test_attack_shortcuts.py (kept_text on texts with escapes), tests/unit/test_stream_send.py
 */
#include "speedups.h"

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

/* The length of the escape orjson writes whose backslash is t[i] (`\"` `\\` `\b` `\f` `\n` `\r` `\t`, `\u00xx` in
   lowercase for another byte below 0x20); 0: none of those (a backslash that ends the bytes starts none). */
static Py_ssize_t
orjson_escape(const unsigned char *t, Py_ssize_t i, Py_ssize_t n)
{
    if (i + 1 >= n)
        return 0;
    unsigned char e = t[i + 1];
    if (e == '"' || e == '\\' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't')
        return 2;
    if (e != 'u' || i + 5 >= n || t[i + 2] != '0' || t[i + 3] != '0')
        return 0;
    int hi = lower_hex(t[i + 4]), lo = lower_hex(t[i + 5]);
    if (hi < 0 || hi > 1 || lo < 0)
        return 0;
    int v = hi * 16 + lo;
    return v == 0x08 || v == 0x09 || v == 0x0a || v == 0x0c || v == 0x0d ? 0 : 6;
}

/* The length of the valid UTF-8 sequence whose lead byte t[i] is 0x80 or above (no surrogate, no overlong,
   nothing past U+10FFFF); 0: not one. */
static Py_ssize_t
utf8_sequence(const unsigned char *t, Py_ssize_t i, Py_ssize_t n)
{
    unsigned char c = t[i], lo = 0x80, hi = 0xbf; /* the bounds of the second byte */
    Py_ssize_t len;
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
    return len;
}

/* `splice.kept_text`: the n bytes at t, one JSON string's bytes, are ones a decode and orjson's encode give
   back as they are: no raw byte below 0x20, no raw quote, valid UTF-8, every backslash the start of one of
   orjson's escapes, read from the string's start: a backslash that ends the bytes starts no escape (the quote
   after it is escaped), so it is refused. */
int
kept_text(const unsigned char *t, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    while (i < n) {
        unsigned char c = t[i];
        if (c >= 0x20 && c < 0x80 && c != '"' && c != '\\') {
            i++;
            continue;
        }
        if (c < 0x80 && c != '\\') /* a byte below 0x20 or a quote */
            return 0;
        Py_ssize_t len = c == '\\' ? orjson_escape(t, i, n) : utf8_sequence(t, i, n);
        if (len == 0)
            return 0;
        i += len;
    }
    return 1;
}

/* `Splice.locate` over a splice's parts: where the ids of a delta the splice serves start; -1 for any other event. */
Py_ssize_t
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

PyObject *
py_kept_text(PyObject *module, PyObject *arg)
{
    (void)module;
    if (!PyBytes_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "bytes expected");
        return NULL;
    }
    return PyBool_FromLong(kept_text((const unsigned char *)PyBytes_AsString(arg), PyBytes_Size(arg)));
}


/* `Splice.render`'s bytes for a delta whose ids sit at body[start:end], `mid` the splice's bytes between the
   delta and its ids in nvext: a new reference (`body` itself when it neither strips nor adds), or NULL with an
   exception set. Python twin: the delta branch of `kernels.python_stream_send`. */
PyObject *
splice_render(PyObject *body, Py_ssize_t start, Py_ssize_t end, PyObject *mid, int strip, int trio)
{
    const char *b = PyBytes_AsString(body), *m = PyBytes_AsString(mid);
    Py_ssize_t lm = PyBytes_Size(mid);
    PyObject *out;
    if (trio) {
        Py_ssize_t cut = strip ? start : end, ids = end - start;
        out = PyBytes_FromStringAndSize(NULL, cut + lm + ids + 4);
        if (out != NULL) {
            char *o = PyBytes_AsString(out);
            memcpy(o, b, cut);
            memcpy(o + cut, m, lm);
            memcpy(o + cut + lm, b + start, ids);
            memcpy(o + cut + lm + ids, "}}\n\n", 4);
        }
        return out;
    }
    if (strip) {
        out = PyBytes_FromStringAndSize(NULL, start + lm);
        if (out != NULL) {
            char *o = PyBytes_AsString(out);
            memcpy(o, b, start);
            memcpy(o + start, m, lm);
        }
        return out;
    }
    Py_INCREF(body);
    return body; /* neither: the delta goes out as vLLM wrote it */
}

/* The usage chunk `stream.StreamReshaper` forwards as it came: one whole event, the root (lr bytes; none: no
   usage chunk does), `]`, no `"choices":` after it. Python twin: `kernels._is_usage`. */
int
usage_as_it_came(const char *b, Py_ssize_t n, const char *root, Py_ssize_t lr)
{
    if (lr == 0 || n < lr + 3 || b[lr] != ']' || memcmp(b, root, lr) != 0)
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
