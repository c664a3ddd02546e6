/* plain_chunk: whether an event is plain JSON orjson writes back, and where its values sit.
 *
 * Python twin: outbound.plain.plain_chunk (read by `outbound.finish.first_chunk` and `outbound.unary.plain_body`)
 * Oracle: tests/unit/test_attack_shortcuts.py (the twins compared), tests/unit/test_stream_finish.py,
 * tests/unit/test_unary_plain.py (the general path's decode)
 *
 * Whether a `data: {...}\n\n` event is plain JSON that orjson writes back byte for byte (no
 * whitespace; strings of printable ASCII without escapes; integers of at most 15 digits, no
 * fraction or exponent; null, true, false; no key twice in an object; at most 16 levels), and
 * where the values the general path reads sit: root `choices` (how many elements, all objects),
 * `prompt_token_ids` and `nvext`; in the first choice `index`, `token_ids`, `prompt_token_ids`
 * and `finish_reason`. outbound/finish.py's `first_chunk` builds the general path's bytes from it;
 * tests/unit/test_stream_finish.py and the stream tests compare them with the general path.
 */
#include "speedups.h"

/* An id (0, or up to 15 digits without a leading zero: finish._ID) at b[i]: the index past it, or -1.
   The integers of the finish tail, of a list of ids and of a plain chunk are read by it. */
Py_ssize_t
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

enum { PC_CHOICES, PC_NCHOICES, PC_ROOT_PROMPT, PC_NVEXT = PC_ROOT_PROMPT + 2, PC_INDEX = PC_NVEXT + 2,
       PC_IDS = PC_INDEX + 2, PC_PROMPT = PC_IDS + 2, PC_FINISH = PC_PROMPT + 2, PC_SIZE = PC_FINISH + 2 };
enum { LEVEL_OTHER, LEVEL_ROOT, LEVEL_CHOICE };
#define PC_MAX_KEYS 64
#define PC_MAX_DEPTH 16

static Py_ssize_t pc_value(const char *b, Py_ssize_t i, Py_ssize_t n, int depth, int level, Py_ssize_t *spans);

Py_ssize_t
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

/* Where the value of the key at b[start:end] (its quotes included) goes among the spans, at this `level`; -1:
   nowhere (PC_CHOICES: the root's `choices`, whose elements pc_value counts). */
static int
pc_slot(const char *b, Py_ssize_t start, Py_ssize_t end, int level)
{
    if (level == LEVEL_ROOT) {
        if (pc_key_is(b, start, end, "choices"))
            return PC_CHOICES;
        if (pc_key_is(b, start, end, "prompt_token_ids"))
            return PC_ROOT_PROMPT;
        if (pc_key_is(b, start, end, "nvext"))
            return PC_NVEXT;
    }
    else if (level == LEVEL_CHOICE) {
        if (pc_key_is(b, start, end, "index"))
            return PC_INDEX;
        if (pc_key_is(b, start, end, "token_ids"))
            return PC_IDS;
        if (pc_key_is(b, start, end, "prompt_token_ids"))
            return PC_PROMPT;
        if (pc_key_is(b, start, end, "finish_reason"))
            return PC_FINISH;
    }
    return -1;
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
        int slot = pc_slot(b, i, key_end, level);
        Py_ssize_t end;
        if (slot == PC_CHOICES) {
            if (b[value] != '[')
                return -1;
            end = pc_value(b, value, n, depth + 1, LEVEL_CHOICE, spans); /* counts its elements */
        }
        else
            end = pc_value(b, value, n, depth + 1, LEVEL_OTHER, spans);
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

PyObject *
plain_chunk(PyObject *module, PyObject *arg)
{
    (void)module;
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

