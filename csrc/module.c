/* vllm_nvext._speedups: the one extension that holds every compiled twin, one file each (each file's head
 * names its Python twin and the test that is its oracle); this file only gathers them into the module.
 *
 * Python twin: each function's, named in its own file
 * Oracle: tests/unit/test_kernels.py (the build: every file, every warning an error)
 */
#include "speedups.h"

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
     "plain_chunk(event): None, or the spans outbound/finish.py's first_chunk reads (see csrc/plain_chunk.c)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups_module = {
    PyModuleDef_HEAD_INIT, "vllm_nvext._speedups", "Compiled stream path of vllm_nvext (optional).", -1,
    speedups_functions, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
    PyObject *m = PyModule_Create(&speedups_module);
    if (m == NULL)
        return NULL;
    if (add_stream_send(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
