/* The compiled twin of `send.python_stream_send`: the `send` handed to vLLM for a
 * reshaped response. Until armed it hands every message to `general` (the ReshapingSend);
 * armed with a stream's `stream.Splice` it serves the mid-stream deltas the splice serves, with
 * the same checks (`Splice.locate`) and the same bytes (`Splice.render`), and returns
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

static PyObject *s_type, *s_body, *s_more_body, *s_body_type, *s_clock;

typedef struct {
    PyObject_HEAD
    PyObject *general;    /* the ReshapingSend: everything the splice does not serve */
    PyObject *downstream; /* the server's send */
    PyObject *prefix, *head, *tail, *mid; /* bytes, as stream.Splice holds them */
    PyObject *on_ids;     /* None, or called with (event, start, end) for each delta served */
    PyObject *tally_add;  /* None (metrics off), or metrics.StreamTally.add */
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

/* Where the ids of a delta the splice serves start; -1 for any other event. */
static Py_ssize_t
locate(StreamSend *self, const char *b, Py_ssize_t n)
{
    Py_ssize_t lp = PyBytes_Size(self->prefix), lh = PyBytes_Size(self->head), lt = PyBytes_Size(self->tail);
    if (n < lp + lh + lt + 2)
        return -1;
    if (memcmp(b, PyBytes_AsString(self->prefix), lp) != 0)
        return -1;
    if (memcmp(b + n - lt, PyBytes_AsString(self->tail), lt) != 0)
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
    if (h < lp || memcmp(b + h, PyBytes_AsString(self->head), lh) != 0)
        return -1;
    /* the text: one JSON string's bytes, none of stream.UNSAFE_TEXT */
    for (Py_ssize_t i = lp; i < h; i++) {
        char c = b[i];
        if (c == '"' || c == '\r' || c == '\n')
            return -1;
    }
    if (h > lp && b[h - 1] == '\\')
        return -1;
    return start;
}

static PyObject *
StreamSend_call(StreamSend *self, PyObject *args, PyObject *kwds)
{
    PyObject *message;
    if (!PyArg_UnpackTuple(args, "send", 1, 1, &message))
        return NULL;
    if (!self->armed || !PyDict_Check(message))
        goto general;
    PyObject *more = PyDict_GetItemWithError(message, s_more_body);
    if (more == NULL) {
        if (PyErr_Occurred())
            return NULL;
        goto general;
    }
    int truth = PyObject_IsTrue(more);
    if (truth < 0)
        return NULL;
    if (!truth)
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
    PyObject *body = PyDict_GetItemWithError(message, s_body);
    if (body == NULL) {
        if (PyErr_Occurred())
            return NULL;
        goto general;
    }
    if (!PyBytes_CheckExact(body))
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
    if (start < 0)
        goto general;
    Py_ssize_t end = n - PyBytes_Size(self->tail);
    Py_INCREF(body); /* the message's body is replaced below */
    if (self->on_ids != Py_None) {
        PyObject *r = PyObject_CallFunction(self->on_ids, "Onn", body, start, end);
        if (r == NULL) {
            Py_DECREF(body);
            return NULL;
        }
        Py_DECREF(r);
    }
    PyObject *out = NULL;
    const char *mid = PyBytes_AsString(self->mid);
    Py_ssize_t lm = PyBytes_Size(self->mid);
    if (self->trio) {
        Py_ssize_t cut = self->strip ? start : end, ids = end - start;
        out = PyBytes_FromStringAndSize(NULL, cut + lm + ids + 4);
        if (out != NULL) {
            char *o = PyBytes_AsString(out);
            memcpy(o, b, cut);
            memcpy(o + cut, mid, lm);
            memcpy(o + cut + lm, b + start, ids);
            memcpy(o + cut + lm + ids, "}}\n\n", 4);
        }
    }
    else if (self->strip) {
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
    if (out == NULL)
        return NULL;
    int failed = PyDict_SetItem(message, s_body, out);
    Py_DECREF(out);
    if (failed)
        return NULL;
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
    PyObject *prefix, *head, *tail, *mid, *on_ids, *tally_add;
    int strip, trio;
    long long left;
    if (!PyArg_ParseTuple(args, "SSSSppOLO:arm", &prefix, &head, &tail, &mid, &strip, &trio, &on_ids, &left,
                          &tally_add))
        return NULL;
    if (!PyBytes_CheckExact(prefix) || !PyBytes_CheckExact(head) || !PyBytes_CheckExact(tail)
        || !PyBytes_CheckExact(mid)) {
        PyErr_SetString(PyExc_TypeError, "arm: the splice's parts must be bytes");
        return NULL;
    }
    if (PyBytes_Size(prefix) < 1 || memchr(PyBytes_AsString(tail), '[', PyBytes_Size(tail)) != NULL) {
        PyErr_SetString(PyExc_ValueError, "arm: not a splice stream.Splice would make");
        return NULL;
    }
    SET_REF(self->prefix, prefix);
    SET_REF(self->head, head);
    SET_REF(self->tail, tail);
    SET_REF(self->mid, mid);
    SET_REF(self->on_ids, on_ids);
    SET_REF(self->tally_add, tally_add);
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
     "arm(prefix, head, tail, mid, strip, trio, on_ids, countdown, tally_add): serve the deltas of this splice"},
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

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT, "vllm_nvext._speedups", "Compiled stream path of vllm_nvext (optional).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    s_type = PyUnicode_InternFromString("type");
    s_body = PyUnicode_InternFromString("body");
    s_more_body = PyUnicode_InternFromString("more_body");
    s_body_type = PyUnicode_InternFromString("http.response.body");
    if (!s_type || !s_body || !s_more_body || !s_body_type)
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
