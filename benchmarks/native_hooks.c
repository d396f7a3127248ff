/* Two forward hooks written in C, for bench_vllm.py's native layers only (issue 35): they answer
 * how much of a dump's cost on a real engine is the interpreter running a hook, and how much is
 * not, by doing a hook's work with no Python frame at all.
 *
 * - Keeper(kept): clones each tensor of a module's output (the output itself, or each tensor of
 *   a flat tuple) and appends it to ``kept``. The ``held`` layer's hook, in C.
 * - Capture(name, recorder, key_text, threshold): what tracedump's recorder does for one module
 *   output in the plain case of a full dump (recorder.py, ``_copy_leaves``), into the recorder's
 *   open pass: the call counted, each tensor cloned (or, from ``threshold`` bytes or off the CPU,
 *   copied by the sink), its key, the entry appended, the pass's bytes and count, the memory cap
 *   consulted. It assumes the plain case (no gate, filter or suspension, every tensor storable)
 *   and hands any other output shape to the recorder: a measuring tool, not a second recorder.
 *
 * Not part of the package: built by bench_vllm.py with the machine's C compiler, where it has one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

static PyObject *s_clone, *s_memory_format, *s_contiguous, *s_current, *s_entries, *s_calls, *s_nbytes,
    *s_kept, *s_room, *s_sink, *s_copy, *s_make_room, *s_is_cpu, *s_requires_grad, *s_on_module_tensors,
    *s_is_input, *s_tensor_type, *s_index_paths[16];
static PyObject *s_clone_kwnames, *s_hook_kwnames; /* ("memory_format",), ("is_input",) */

static int is_tensor(PyObject *o) { return PyObject_TypeCheck(o, (PyTypeObject *)s_tensor_type); }

/* A clone into contiguous memory (a non-contiguous output becomes a dense copy). */
static PyObject *contiguous_clone(PyObject *tensor) {
    PyObject *args[2] = {tensor, s_contiguous};
    return PyObject_VectorcallMethod(s_clone, args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET, s_clone_kwnames);
}

/* ------------------------------------------------------------------------------- Keeper */

typedef struct {
    PyObject_HEAD vectorcallfunc call;
    PyObject *kept;
} Keeper;

static int keep(Keeper *self, PyObject *tensor) {
    PyObject *copy = contiguous_clone(tensor);
    if (copy == NULL) return -1;
    int failed = PyList_Append(self->kept, copy);
    Py_DECREF(copy);
    return failed;
}

static PyObject *keeper_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Keeper *self = (Keeper *)op;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a forward hook takes (module, args, output)");
        return NULL;
    }
    PyObject *output = args[2];
    if (is_tensor(output)) {
        if (keep(self, output) < 0) return NULL;
    } else if (PyTuple_CheckExact(output)) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(output); i++) {
            PyObject *item = PyTuple_GET_ITEM(output, i);
            if (is_tensor(item) && keep(self, item) < 0) return NULL;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *keeper_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *kept;
    if (!PyArg_ParseTuple(args, "O!:Keeper", &PyList_Type, &kept)) return NULL;
    Keeper *self = (Keeper *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->call = keeper_call;
    self->kept = Py_NewRef(kept);
    return (PyObject *)self;
}

static void keeper_dealloc(Keeper *self) {
    Py_XDECREF(self->kept);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject KeeperType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_hooks.Keeper",
    .tp_basicsize = sizeof(Keeper),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = keeper_new,
    .tp_dealloc = (destructor)keeper_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Keeper, call),
};

/* ------------------------------------------------------------------------------ Capture */

typedef struct {
    PyObject_HEAD vectorcallfunc call;
    PyObject *name, *recorder, *key_text;
    Py_ssize_t threshold;
} Capture;

/* pass.<attr> += delta, on an int attribute */
static int add_to(PyObject *pass, PyObject *attr, Py_ssize_t delta) {
    PyObject *value = PyObject_GetAttr(pass, attr);
    if (value == NULL) return -1;
    Py_ssize_t now = PyLong_AsSsize_t(value);
    Py_DECREF(value);
    if (now == -1 && PyErr_Occurred()) return -1;
    PyObject *sum = PyLong_FromSsize_t(now + delta);
    if (sum == NULL) return -1;
    int failed = PyObject_SetAttr(pass, attr, sum);
    Py_DECREF(sum);
    return failed;
}

/* The copy and its event: a clone for a small CPU tensor, the sink's copy for any other. */
static PyObject *copy_of(Capture *self, PyObject *tensor, Py_ssize_t nbytes) {
    if (nbytes < self->threshold) {
        PyObject *cpu = PyObject_GetAttr(tensor, s_is_cpu);
        if (cpu == NULL) return NULL;
        PyObject *grad = PyObject_GetAttr(tensor, s_requires_grad);
        int plain = cpu == Py_True && grad == Py_False;
        Py_DECREF(cpu);
        Py_XDECREF(grad);
        if (grad == NULL) return NULL;
        if (plain) {
            PyObject *copy = contiguous_clone(tensor);
            if (copy == NULL) return NULL;
            PyObject *pair = PyTuple_Pack(2, copy, Py_None);
            Py_DECREF(copy);
            return pair;
        }
    }
    PyObject *sink = PyObject_GetAttr(self->recorder, s_sink);
    if (sink == NULL) return NULL;
    PyObject *pair = PyObject_CallMethodOneArg(sink, s_copy, tensor);
    Py_DECREF(sink);
    return pair;
}

/* The memory cap, as _copy_leaves consults it: the room read once, make_room past it. */
static int within_room(Capture *self, PyObject *pass) {
    PyObject *room = PyObject_GetAttr(pass, s_room);
    if (room == NULL) return -1;
    if (room == Py_None) {
        Py_DECREF(room);
        PyObject *sink = PyObject_GetAttr(self->recorder, s_sink);
        if (sink == NULL) return -1;
        room = PyObject_CallMethodNoArgs(sink, s_room);
        Py_DECREF(sink);
        if (room == NULL || PyObject_SetAttr(pass, s_room, room) < 0) {
            Py_XDECREF(room);
            return -1;
        }
    }
    PyObject *held = PyObject_GetAttr(pass, s_nbytes);
    int over = held == NULL ? -1 : PyObject_RichCompareBool(held, room, Py_GT);
    Py_XDECREF(held);
    Py_DECREF(room);
    if (over <= 0) return over;
    PyObject *done = PyObject_CallMethodOneArg(self->recorder, s_make_room, pass);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

static int capture_leaf(Capture *self, PyObject *pass, long call, PyObject *suffix, PyObject *tensor) {
    PyObject *size = PyObject_GetAttr(tensor, s_nbytes);
    if (size == NULL) return -1;
    Py_ssize_t nbytes = PyLong_AsSsize_t(size);
    Py_DECREF(size);
    if (nbytes == -1 && PyErr_Occurred()) return -1;
    PyObject *pair = copy_of(self, tensor, nbytes);
    if (pair == NULL) return -1;
    PyObject *key = call == 0 ? PyUnicode_Concat(self->name, suffix)
                              : PyObject_CallFunction(self->key_text, "OOOl", self->name, suffix, Py_False, call);
    PyObject *entries = key == NULL ? NULL : PyObject_GetAttr(pass, s_entries);
    PyObject *entry = entries == NULL ? NULL : PyTuple_Pack(3, key, PyTuple_GET_ITEM(pair, 0), PyTuple_GET_ITEM(pair, 1));
    int failed = entry == NULL || PyList_Append(entries, entry) < 0;
    Py_XDECREF(entry);
    Py_XDECREF(entries);
    Py_XDECREF(key);
    Py_DECREF(pair);
    if (failed || add_to(pass, s_nbytes, nbytes) < 0 || add_to(pass, s_kept, 1) < 0) return -1;
    return within_room(self, pass);
}

static PyObject *capture_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Capture *self = (Capture *)op;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a forward hook takes (module, args, output)");
        return NULL;
    }
    PyObject *output = args[2];
    int single = is_tensor(output);
    if (!single && !(PyTuple_CheckExact(output) && PyTuple_GET_SIZE(output) <= 16)) {
        goto recorder; /* any other shape: the recorder's own walk */
    }
    if (!single) {
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(output); i++) {
            PyObject *item = PyTuple_GET_ITEM(output, i);
            if (item != Py_None && !is_tensor(item)) goto recorder;
        }
    }
    PyObject *pass = PyObject_GetAttr(self->recorder, s_current);
    if (pass == NULL) return NULL;
    if (pass == Py_None) {
        Py_DECREF(pass);
        Py_RETURN_NONE;
    }
    PyObject *calls = PyObject_GetAttr(pass, s_calls);
    PyObject *seen = calls == NULL ? NULL : PyDict_GetItemWithError(calls, self->name);
    long call = seen == NULL ? 0 : PyLong_AsLong(seen);
    PyObject *next = calls == NULL || PyErr_Occurred() ? NULL : PyLong_FromLong(call + 1);
    int failed = next == NULL || PyDict_SetItem(calls, self->name, next) < 0;
    Py_XDECREF(next);
    Py_XDECREF(calls);
    if (single) {
        failed = failed || capture_leaf(self, pass, call, s_index_paths[0], output) < 0;
    } else {
        for (Py_ssize_t i = 0; !failed && i < PyTuple_GET_SIZE(output); i++) {
            PyObject *item = PyTuple_GET_ITEM(output, i);
            failed = item != Py_None && capture_leaf(self, pass, call, s_index_paths[i + 1], item) < 0;
        }
    }
    Py_DECREF(pass);
    if (failed) return NULL;
    Py_RETURN_NONE;
recorder:;
    /* recorder.on_module_tensors(name, output, is_input=False) */
    PyObject *call_args[4] = {self->recorder, self->name, output, Py_False};
    return PyObject_VectorcallMethod(s_on_module_tensors, call_args, 3, s_hook_kwnames);
}

static PyObject *capture_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *name, *recorder, *key_text;
    Py_ssize_t threshold;
    if (!PyArg_ParseTuple(args, "UOOn:Capture", &name, &recorder, &key_text, &threshold)) return NULL;
    Capture *self = (Capture *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->call = capture_call;
    self->name = Py_NewRef(name);
    self->recorder = Py_NewRef(recorder);
    self->key_text = Py_NewRef(key_text);
    self->threshold = threshold;
    return (PyObject *)self;
}

static void capture_dealloc(Capture *self) {
    Py_XDECREF(self->name);
    Py_XDECREF(self->recorder);
    Py_XDECREF(self->key_text);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject CaptureType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "native_hooks.Capture",
    .tp_basicsize = sizeof(Capture),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_new = capture_new,
    .tp_dealloc = (destructor)capture_dealloc,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Capture, call),
};

/* ------------------------------------------------------------------------------- module */

static int intern_all(void) {
    const char *names[] = {"clone", "memory_format", "current", "entries", "calls", "nbytes", "kept",
                           "room", "sink", "copy", "_make_room", "is_cpu", "requires_grad",
                           "on_module_tensors", "is_input"};
    PyObject **slots[] = {&s_clone, &s_memory_format, &s_current, &s_entries, &s_calls, &s_nbytes, &s_kept,
                          &s_room, &s_sink, &s_copy, &s_make_room, &s_is_cpu, &s_requires_grad,
                          &s_on_module_tensors, &s_is_input};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if ((*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) return -1;
    }
    s_clone_kwnames = PyTuple_Pack(1, s_memory_format);
    s_hook_kwnames = PyTuple_Pack(1, s_is_input);
    if (s_clone_kwnames == NULL || s_hook_kwnames == NULL) return -1;
    /* "" for a single tensor, then "[0]" .. "[15]": a flat tuple's paths, as flat_leaves names them */
    if ((s_index_paths[0] = PyUnicode_FromString("")) == NULL) return -1;
    for (int i = 0; i < 15; i++) {
        if ((s_index_paths[i + 1] = PyUnicode_FromFormat("[%d]", i)) == NULL) return -1;
    }
    return 0;
}

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "native_hooks", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_native_hooks(void) {
    if (PyType_Ready(&KeeperType) < 0 || PyType_Ready(&CaptureType) < 0 || intern_all() < 0) return NULL;
    PyObject *torch = PyImport_ImportModule("torch");
    if (torch == NULL) return NULL;
    s_tensor_type = PyObject_GetAttrString(torch, "Tensor");
    s_contiguous = PyObject_GetAttrString(torch, "contiguous_format");
    Py_DECREF(torch);
    if (s_tensor_type == NULL || s_contiguous == NULL) return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Keeper", (PyObject *)&KeeperType) < 0 ||
        PyModule_AddObjectRef(module, "Capture", (PyObject *)&CaptureType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
