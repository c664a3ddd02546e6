/* What the files of vllm_nvext._speedups share: one extension, one file per compiled twin (each file's head
 * names its Python twin and the test that is its oracle). Built on the limited API (abi3, CPython >= 3.10):
 * one wheel per platform serves every version.
 */
#ifndef NVEXT_SPEEDUPS_H
#define NVEXT_SPEEDUPS_H

#define Py_LIMITED_API 0x030A0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

/* Shared between the files of the one extension, never exported from it. */
#if defined(__GNUC__) || defined(__clang__)
#define NVEXT_INTERNAL __attribute__((visibility("hidden")))
#else
#define NVEXT_INTERNAL
#endif

/* Py_XSETREF is not part of the limited API */
#define SET_REF(field, value) do { PyObject *old_ = (field); Py_INCREF(value); (field) = (value); Py_XDECREF(old_); } while (0)
/* the same for a new reference or NULL */
#define Py_XSETREF_(field, value) do { PyObject *old_ = (field); (field) = (value); Py_XDECREF(old_); } while (0)

#define NVEXT_IDS ",\"nvext\":{\"completion_token_ids\":"

/* locate.c: `splice.kept_text` over n bytes; `Splice.locate` over a splice's parts. */
NVEXT_INTERNAL int kept_text(const unsigned char *t, Py_ssize_t n);
NVEXT_INTERNAL Py_ssize_t splice_locate(const char *b, Py_ssize_t n, const char *prefix, Py_ssize_t lp,
                                        const char *head, Py_ssize_t lh, const char *tail, Py_ssize_t lt);
NVEXT_INTERNAL PyObject *py_kept_text(PyObject *module, PyObject *arg);
/* locate.c: what an armed send writes for a delta (`Splice.render`), which usage chunk goes out as it came. */
NVEXT_INTERNAL PyObject *splice_render(PyObject *body, Py_ssize_t start, Py_ssize_t end, PyObject *mid, int strip,
                                       int trio);
NVEXT_INTERNAL int usage_as_it_came(const char *b, Py_ssize_t n, const char *root, Py_ssize_t lr);

/* plain_chunk.c: the plain grammar's scanners (an id; a string of printable ASCII without escapes). */
NVEXT_INTERNAL Py_ssize_t id_end(const char *b, Py_ssize_t i, Py_ssize_t n);
NVEXT_INTERNAL Py_ssize_t pc_string(const char *b, Py_ssize_t i, Py_ssize_t n);
NVEXT_INTERNAL PyObject *plain_chunk(PyObject *module, PyObject *arg);

/* finish_ids.c: `finish.finish_ids` over bytes, and as the module's function. */
NVEXT_INTERNAL int finish_span(const char *b, Py_ssize_t n, const char *prefix, Py_ssize_t lp, const char *fh,
                               Py_ssize_t lf, Py_ssize_t root_end, Py_ssize_t *start, Py_ssize_t *end);
NVEXT_INTERNAL PyObject *py_finish_ids(PyObject *module, PyObject *args);
/* finish_ids.c: the finish chunk's bytes with its nvext (`finish.finish_chunk`'s). */
NVEXT_INTERNAL PyObject *finish_render(PyObject *body, Py_ssize_t fs, Py_ssize_t fe, int strip, PyObject *nvext);

/* learn_splice.c, splice_root.c */
NVEXT_INTERNAL PyObject *learn_splice(PyObject *module, PyObject *args);
NVEXT_INTERNAL PyObject *splice_root(PyObject *module, PyObject *args);

/* stream_send.c: adds the StreamSend type to the module; -1 with an exception set on failure. */
NVEXT_INTERNAL int add_stream_send(PyObject *module);

#endif
