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

static PyObject *
StreamSend_call(StreamSend *self, PyObject *args, PyObject *kwds)
{
    (void)kwds;
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
        /* the finish chunk of choice 0: recorded by its owner (ChunkReshaper.finish_first_choice), which gives
           its nvext; then finish.finish_chunk's bytes */
        PyObject *record = self->finish_record; /* held across the call below (which could arm the send anew) */
        int strip = self->strip;
        Py_INCREF(body);
        Py_INCREF(record);
        Py_CLEAR(self->finish_head); /* served once: a second finish chunk goes to the general path */
        PyObject *nvext = PyObject_CallFunction(record, "Onn", body, fs, fe);
        Py_DECREF(record);
        if (nvext == NULL || !PyBytes_CheckExact(nvext)) {
            /* None (already finished), or it failed: the general path tries it again, and forwards it unchanged
               if it fails again */
            PyErr_Clear();
            Py_XDECREF(nvext);
            Py_DECREF(body);
            goto general;
        }
        Py_ssize_t cut = strip ? fs : n - 3, kept = strip ? n - 3 - fe : 0, lv = PyBytes_Size(nvext);
        PyObject *finished = PyBytes_FromStringAndSize(NULL, cut + (strip ? 4 : 0) + kept + 9 + lv + 3);
        if (finished == NULL) {
            Py_DECREF(nvext);
            Py_DECREF(body);
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
        memcpy(o, ",\"nvext\":", 9);
        memcpy(o + 9, PyBytes_AsString(nvext), lv);
        memcpy(o + 9 + lv, "}\n\n", 3);
        Py_DECREF(nvext);
        Py_DECREF(body);
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
            /* ids a decode refuses (kernels.python_stream_send): the general path forwards the delta unchanged and
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
