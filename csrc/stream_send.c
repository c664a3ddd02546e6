/* StreamSend: the `send` handed to vLLM for a reshaped response.
 *
 * Python twin: `kernels.python_stream_send`
 * Oracle: tests/unit/test_stream_send.py (every recorded stream, hypothesis layouts),
 *         tests/unit/test_stream_finish.py (the finish chunk it serves)
 *
 * Until armed it hands every message to `general` (the ReshapingSend); armed with a stream's
 * `splice.Splice` it serves the mid-stream deltas the splice serves, with the same checks
 * (`Splice.locate`) and the same bytes (`Splice.render`), and `data: [DONE]` and the usage chunk as they
 * came (`send._is_usage`), the stream's closing empty message, and the finish chunk of choice 0 when it was
 * armed for one (`finish.finish_chunk`'s bytes, `finish_span` in finish_ids.c), and returns `downstream`'s
 * awaitable.
 */
#include "speedups.h"

static PyObject *s_type, *s_body, *s_more_body, *s_body_type, *s_clock;

typedef struct {
    PyObject_HEAD
    PyObject *general;    /* the ReshapingSend: everything the splice does not serve */
    PyObject *downstream; /* the server's send */
    PyObject *prefix, *head, *tail, *mid; /* bytes, as splice.Splice holds them */
    PyObject *on_ids;     /* None, or called with (event, start, end) for each delta served */
    PyObject *tally_add;  /* None (metrics off), or metrics.StreamTally.add */
    PyObject *root;       /* bytes: the root of a usage chunk that goes out as it came (empty: none does) */
    /* The finish chunk of choice 0 (finish.finish_chunk, splice.FinishArm): NULL, or the armed splice's bytes
       before a finish reason; where `choices`' first element starts; what records it and gives its nvext
       (chunks.ChunkReshaper.finish_first_choice: the one writer of the stream's state) */
    PyObject *finish_head, *finish_record;
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
    Py_VISIT(self->finish_record);
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
    Py_CLEAR(self->finish_record);
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
/* What an armed send does with `message`. */
enum { TO_GENERAL, CLOSING, SERVABLE };

/* SERVABLE: a body message with more to come, whose body (borrowed, into *body) is bytes; CLOSING: the stream's
   closing empty message, out as it came (nothing is held or waits while armed; not counted: the general path
   counts it as a framed message of no event); TO_GENERAL: anything else, or the send is not armed; -1: an error. */
static int
classify(StreamSend *self, PyObject *message, PyObject **body)
{
    if (!self->armed || !PyDict_Check(message))
        return TO_GENERAL;
    PyObject *kind = PyDict_GetItemWithError(message, s_type);
    if (kind == NULL)
        return PyErr_Occurred() ? -1 : TO_GENERAL;
    int is_body = PyObject_RichCompareBool(kind, s_body_type, Py_EQ);
    if (is_body <= 0)
        return is_body < 0 ? -1 : TO_GENERAL;
    PyObject *more = PyDict_GetItemWithError(message, s_more_body);
    if (more == NULL && PyErr_Occurred())
        return -1;
    int truth = more == NULL ? 0 : PyObject_IsTrue(more);
    if (truth < 0)
        return -1;
    *body = PyDict_GetItemWithError(message, s_body);
    if (*body == NULL && PyErr_Occurred())
        return -1;
    if (!truth)
        return *body == NULL || (PyBytes_CheckExact(*body) && PyBytes_Size(*body) == 0) ? CLOSING : TO_GENERAL;
    return *body != NULL && PyBytes_CheckExact(*body) ? SERVABLE : TO_GENERAL;
}

/* `message`'s body becomes `out` (a new reference, released here; NULL: an error already set): 1, or -1. */
static int
set_body(PyObject *message, PyObject *out)
{
    if (out == NULL)
        return -1;
    int failed = PyDict_SetItem(message, s_body, out);
    Py_DECREF(out);
    return failed ? -1 : 1;
}

/* A delta the armed splice serves, its ids at b[start:] (`body`'s bytes, n of them), reported to `on_ids` and
   rendered by the splice it was matched against (both held across the call, which could arm the send anew):
   1, `message` holds its bytes; 0, the general path's (ids a decode refuses: it forwards the delta unchanged and
   counts it, as it does without the armed send); -1, an error. */
static int
serve_delta(StreamSend *self, PyObject *message, PyObject *body, Py_ssize_t n, Py_ssize_t start)
{
    Py_ssize_t end = n - PyBytes_Size(self->tail);
    PyObject *mid = self->mid;
    int strip = self->strip, trio = self->trio;
    Py_INCREF(body); /* the message's body is replaced below */
    Py_INCREF(mid);
    if (self->on_ids != Py_None) {
        PyObject *r = PyObject_CallFunction(self->on_ids, "Onn", body, start, end);
        if (r == NULL) {
            Py_DECREF(body);
            Py_DECREF(mid);
            if (!PyErr_ExceptionMatches(PyExc_Exception))
                return -1;
            PyErr_Clear();
            return 0;
        }
        Py_DECREF(r);
    }
    PyObject *out = splice_render(body, start, end, mid, strip, trio);
    Py_DECREF(body);
    Py_DECREF(mid);
    return set_body(message, out);
}

/* Choice 0's finish chunk, when the send was armed for one and `body` is it (`finish.finish_chunk`'s bytes):
   recorded by its owner (ChunkReshaper.finish_first_choice, held across the call, which could arm the send
   anew), which gives its nvext. 1, `message` holds its bytes; 0, the general path's (not it; None, already
   finished; or the record failed: the general path tries it again, and forwards it unchanged if it fails
   again); -1, an error. */
static int
serve_finish(StreamSend *self, PyObject *message, PyObject *body, const char *b, Py_ssize_t n)
{
    Py_ssize_t fs, fe;
    if (self->finish_head == NULL
        || !finish_span(b, n, PyBytes_AsString(self->prefix), PyBytes_Size(self->prefix),
                        PyBytes_AsString(self->finish_head), PyBytes_Size(self->finish_head), self->finish_root,
                        &fs, &fe))
        return 0;
    PyObject *record = self->finish_record;
    int strip = self->strip;
    Py_INCREF(body);
    Py_INCREF(record);
    Py_CLEAR(self->finish_head); /* served once: a second finish chunk goes to the general path */
    PyObject *nvext = PyObject_CallFunction(record, "Onn", body, fs, fe);
    Py_DECREF(record);
    if (nvext == NULL || !PyBytes_CheckExact(nvext)) {
        PyErr_Clear();
        Py_XDECREF(nvext);
        Py_DECREF(body);
        return 0;
    }
    PyObject *out = finish_render(body, fs, fe, strip, nvext);
    Py_DECREF(nvext);
    Py_DECREF(body);
    return set_body(message, out);
}

/* The message goes out: the metrics countdown kept (the message at 1 timed from `t0`); `downstream`'s awaitable. */
static PyObject *
count_and_send(StreamSend *self, PyObject *message, long long t0)
{
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
}

static PyObject *
StreamSend_call(StreamSend *self, PyObject *args, PyObject *kwds)
{
    (void)kwds;
    PyObject *message, *body = NULL;
    if (!PyArg_UnpackTuple(args, "send", 1, 1, &message))
        return NULL;
    int kind = classify(self, message, &body);
    if (kind < 0)
        return NULL;
    if (kind == CLOSING)
        return PyObject_CallFunctionObjArgs(self->downstream, message, NULL);
    if (kind == TO_GENERAL)
        return PyObject_CallFunctionObjArgs(self->general, message, NULL);
    long long t0 = 0;
    if (self->left == 1 && self->tally_add != Py_None) {
        t0 = clock_ns();
        if (t0 < 0)
            return NULL;
    }
    const char *b = PyBytes_AsString(body);
    Py_ssize_t n = PyBytes_Size(body);
    Py_ssize_t start = splice_locate(b, n, PyBytes_AsString(self->prefix), PyBytes_Size(self->prefix),
                                     PyBytes_AsString(self->head), PyBytes_Size(self->head),
                                     PyBytes_AsString(self->tail), PyBytes_Size(self->tail));
    int served;
    if (start >= 0)
        served = serve_delta(self, message, body, n, start);
    else if ((n == 14 && memcmp(b, "data: [DONE]\n\n", 14) == 0)
             || usage_as_it_came(b, n, PyBytes_AsString(self->root), PyBytes_Size(self->root)))
        served = 1; /* the end of the stream, the usage chunk: out as they came (nothing waits while armed) */
    else
        served = serve_finish(self, message, body, b, n);
    if (served < 0)
        return NULL;
    if (served == 0)
        return PyObject_CallFunctionObjArgs(self->general, message, NULL);
    return count_and_send(self, message, t0);
}

/* arm(countdown, tally_add, splice): `splice` a splice.SpliceArm (its fields read in order, as a tuple),
   its `finish` None or a splice.FinishArm. */
static PyObject *
StreamSend_arm(StreamSend *self, PyObject *args)
{
    PyObject *splice, *prefix, *head, *tail, *mid, *on_ids, *tally_add, *root, *finish;
    PyObject *finish_head = NULL, *finish_record = NULL;
    Py_ssize_t finish_root = 0;
    int strip, trio;
    long long left;
    if (!PyArg_ParseTuple(args, "LOO!:arm", &left, &tally_add, &PyTuple_Type, &splice))
        return NULL;
    if (!PyArg_ParseTuple(splice, "SSSSppOSO:arm's splice", &prefix, &head, &tail, &mid, &strip, &trio, &on_ids,
                          &root, &finish))
        return NULL;
    if (finish != Py_None) {
        if (!PyTuple_Check(finish)) {
            PyErr_SetString(PyExc_TypeError, "arm: finish must be None or a splice.FinishArm");
            return NULL;
        }
        if (!PyArg_ParseTuple(finish, "SnO:arm's finish", &finish_head, &finish_root, &finish_record))
            return NULL;
    }
    if (!PyBytes_CheckExact(prefix) || !PyBytes_CheckExact(head) || !PyBytes_CheckExact(tail)
        || !PyBytes_CheckExact(mid) || !PyBytes_CheckExact(root)
        || (finish_head != NULL && !PyBytes_CheckExact(finish_head))) {
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
    Py_XINCREF(finish_record);
    Py_XSETREF_(self->finish_record, finish_record);
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
    (void)unused;
    self->armed = 0;
    Py_RETURN_NONE;
}

static PyObject *
StreamSend_countdown(StreamSend *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromLongLong(self->left);
}

static PyMethodDef StreamSend_methods[] = {
    {"arm", (PyCFunction)StreamSend_arm, METH_VARARGS,
     "arm(countdown, tally_add, splice): serve the deltas of this splice.SpliceArm (and choice 0's finish chunk "
     "when its finish is a splice.FinishArm)"},
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

int
add_stream_send(PyObject *module)
{
    s_type = PyUnicode_InternFromString("type");
    s_body = PyUnicode_InternFromString("body");
    s_more_body = PyUnicode_InternFromString("more_body");
    s_body_type = PyUnicode_InternFromString("http.response.body");
    if (!s_type || !s_body || !s_more_body || !s_body_type)
        return -1;
    PyObject *time = PyImport_ImportModule("time");
    if (time == NULL)
        return -1;
    s_clock = PyObject_GetAttrString(time, "perf_counter_ns");
    Py_DECREF(time);
    if (s_clock == NULL)
        return -1;
    PyObject *type = PyType_FromSpec(&StreamSend_spec);
    if (type == NULL || PyModule_AddObject(module, "StreamSend", type) < 0) {
        Py_XDECREF(type);
        return -1;
    }
    return 0;
}
