/* Two forward hooks written in C, for bench_vllm.py's native layers only (issue 35): they answer
 * how much of a dump's cost on a real engine is the interpreter running a hook, and how much is
 * not, by doing a hook's work with no Python frame at all.
 *
 * - Keeper(kept): clones each tensor of a module's output (the output itself, or each tensor of
 *   a flat tuple) and appends it to ``kept``. The ``held`` layer's hook, in C.
 * - Capture(name, recorder, rundir): what tracedump's recorder does for one module output in the
 *   plain case of a full dump (recorder.py: ``on_module_tensors``'s test, then ``_copy_leaves``),
 *   into the recorder's open pass: the call counted, each tensor cloned (or, from
 *   ``cuda.POOLED_FROM_BYTES`` or off the CPU, copied by the sink), its key, the entry, the pass's
 *   bytes and count, the memory cap. Every other case goes to the recorder itself: no pass open,
 *   a pass not kept or implicit, the dumper idle, a filter, a suspension, a refused step, another
 *   thread's pass, a failed writer, an output that is not a tensor or a flat tuple of tensors and
 *   None, a tensor no pass file can hold. A failure is reported to the recorder, never raised into
 *   the forward. What it does not test is fixed for a dump: full mode, no gate, no CUDA (checked
 *   by benchmarks/native.py before it swaps these hooks in). A measuring tool, not a second recorder.
 *
 * Not part of the package: built by bench_vllm.py with the machine's C compiler, where it has one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <stddef.h>

#define MAX_LEAVES 16 /* a flat tuple's items with an index path (hooks.py, _INDEX_PATHS) */

static PyObject *s_clone, *s_memory_format, *s_contiguous, *s_current, *s_entries, *s_calls, *s_nbytes,
    *s_kept, *s_room, *s_sink, *s_copy, *s_make_room, *s_is_cpu, *s_requires_grad, *s_on_module_tensors,
    *s_is_input, *s_report, *s_dtype, *s_layout, *s_is_nested, *s_is_meta, *s_gateless, *s_idle,
    *s_name_filter, *s_suspend_depth, *s_refused_steps, *s_selected, *s_implicit, *s_owner, *s_failure;
static PyObject *s_tensor_type, *s_strided, *s_storable_dtypes, *s_suspension, *s_key_text;
static PyObject *s_index_paths[MAX_LEAVES + 1]; /* "" for a tensor, then "[0]" .. "[15]" */
static PyObject *s_clone_kwnames, *s_hook_kwnames; /* ("memory_format",), ("is_input",) */
static Py_ssize_t s_pooled_from;                   /* cuda.POOLED_FROM_BYTES */

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
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Keeper(kept) takes no keyword arguments");
        return NULL;
    }
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
    PyObject *name, *recorder, *rundir;
} Capture;

/* 1 when obj.attr is true, 0 when false, -1 on an error */
static int attr_true(PyObject *obj, PyObject *attr) {
    PyObject *value = PyObject_GetAttr(obj, attr);
    if (value == NULL) return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* 1 when obj.attr is None, 0 when not, -1 on an error */
static int attr_none(PyObject *obj, PyObject *attr) {
    PyObject *value = PyObject_GetAttr(obj, attr);
    if (value == NULL) return -1;
    int none = value == Py_None;
    Py_DECREF(value);
    return none;
}

/* The recorder's plain case (on_module_tensors' first test, _copy_leaves' failure test): 1, 0, -1 */
static int plain_case(Capture *self, PyObject *pass) {
    PyObject *recorder = self->recorder;
    int yes = attr_true(recorder, s_gateless);
    if (yes != 1) return yes;
    if ((yes = attr_true(pass, s_selected)) != 1) return yes;
    PyObject *tests[][2] = {{pass, s_implicit}, {recorder, s_idle}, {recorder, s_suspend_depth},
                            {recorder, s_refused_steps}};
    for (size_t i = 0; i < sizeof(tests) / sizeof(tests[0]); i++) {
        int set = attr_true(tests[i][0], tests[i][1]);
        if (set != 0) return set < 0 ? -1 : 0;
    }
    if ((yes = attr_none(recorder, s_name_filter)) != 1) return yes;
    if ((yes = attr_none(self->rundir, s_failure)) != 1) return yes;
    PyObject *suspended;
    if (PyContextVar_Get(s_suspension, NULL, &suspended) < 0) return -1;
    int depth = suspended == NULL ? 0 : PyObject_IsTrue(suspended);
    Py_XDECREF(suspended);
    if (depth != 0) return depth < 0 ? -1 : 0;
    PyObject *owner = PyObject_GetAttr(pass, s_owner);
    if (owner == NULL) return -1;
    int mine = owner == Py_None;
    if (!mine) {
        unsigned long ident = PyLong_AsUnsignedLong(owner);
        mine = !(ident == (unsigned long)-1 && PyErr_Occurred()) && ident == PyThread_get_thread_ident();
    }
    Py_DECREF(owner);
    return PyErr_Occurred() ? -1 : mine;
}

/* 1 when a pass file can hold the tensor (writer.py, storable), 0 when not, -1 on an error */
static int storable(PyObject *tensor) {
    PyObject *dtype = PyObject_GetAttr(tensor, s_dtype);
    if (dtype == NULL) return -1;
    int ours = PySet_Contains(s_storable_dtypes, dtype);
    Py_DECREF(dtype);
    if (ours != 1) return ours;
    PyObject *layout = PyObject_GetAttr(tensor, s_layout);
    if (layout == NULL) return -1;
    int strided = layout == s_strided;
    Py_DECREF(layout);
    if (!strided) return 0;
    int set = attr_true(tensor, s_is_nested);
    if (set != 0) return set < 0 ? -1 : 0;
    set = attr_true(tensor, s_is_meta);
    return set < 0 ? -1 : !set;
}

/* How many tensors the output holds, when it is a tensor or a flat tuple of storable tensors and
 * None (the shapes the plain path takes); -1 for any other, which the recorder takes; -2 on an error. */
static Py_ssize_t plain_leaves(PyObject *output) {
    if (is_tensor(output)) {
        int ok = storable(output);
        return ok < 0 ? -2 : ok ? 1 : -1;
    }
    if (!PyTuple_CheckExact(output) || PyTuple_GET_SIZE(output) > MAX_LEAVES) return -1;
    Py_ssize_t found = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(output); i++) {
        PyObject *item = PyTuple_GET_ITEM(output, i);
        if (item == Py_None) continue;
        if (!is_tensor(item)) return -1;
        int ok = storable(item);
        if (ok <= 0) return ok < 0 ? -2 : -1;
        found++;
    }
    return found;
}

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

/* The copy and its event (a 2-tuple): a clone for a small CPU tensor, the sink's copy for any
 * other (sinks.py, FileSink.copy). */
static PyObject *copy_of(Capture *self, PyObject *tensor, Py_ssize_t nbytes) {
    if (nbytes < s_pooled_from) {
        int cpu = attr_true(tensor, s_is_cpu);
        int grad = cpu < 0 ? -1 : attr_true(tensor, s_requires_grad);
        if (grad < 0) return NULL;
        if (cpu && !grad) {
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
    if (pair != NULL && !(PyTuple_Check(pair) && PyTuple_GET_SIZE(pair) == 2)) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "the sink's copy() must return (copy, event)");
        return NULL;
    }
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
                              : PyObject_CallFunction(s_key_text, "OOOl", self->name, suffix, Py_False, call);
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

/* The call counted (Pass.next_call), then each tensor kept under its index path. */
static int capture_output(Capture *self, PyObject *pass, PyObject *output) {
    PyObject *calls = PyObject_GetAttr(pass, s_calls);
    if (calls == NULL) return -1;
    PyObject *seen = PyDict_GetItemWithError(calls, self->name);
    long call = seen == NULL ? 0 : PyLong_AsLong(seen);
    PyObject *next = PyErr_Occurred() ? NULL : PyLong_FromLong(call + 1);
    int failed = next == NULL || PyDict_SetItem(calls, self->name, next) < 0;
    Py_XDECREF(next);
    Py_DECREF(calls);
    if (failed) return -1;
    if (is_tensor(output)) return capture_leaf(self, pass, call, s_index_paths[0], output);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(output); i++) {
        PyObject *item = PyTuple_GET_ITEM(output, i);
        if (item != Py_None && capture_leaf(self, pass, call, s_index_paths[i + 1], item) < 0) return -1;
    }
    return 0;
}

/* As the recorder's own hot path: a failure is reported (recorder.report), never raised. */
static PyObject *reported(Capture *self) {
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback != NULL && value != NULL) PyException_SetTraceback(value, traceback);
    PyObject *done = value == NULL ? NULL : PyObject_CallMethodObjArgs(self->recorder, s_report, self->name, value, NULL);
    if (done == NULL) PyErr_WriteUnraisable(self->recorder);
    Py_XDECREF(done);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(traceback);
    Py_RETURN_NONE;
}

static PyObject *capture_call(PyObject *op, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Capture *self = (Capture *)op;
    if (PyVectorcall_NARGS(nargsf) != 3 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a forward hook takes (module, args, output)");
        return NULL;
    }
    PyObject *output = args[2];
    Py_ssize_t leaves = plain_leaves(output);
    if (leaves == -2) return reported(self);
    PyObject *pass = leaves < 0 ? NULL : PyObject_GetAttr(self->recorder, s_current);
    if (leaves >= 0 && pass == NULL) return reported(self);
    int plain = pass == NULL || pass == Py_None ? 0 : plain_case(self, pass);
    if (plain == 1 && leaves > 0 && capture_output(self, pass, output) < 0) plain = -1;
    Py_XDECREF(pass);
    if (plain < 0) return reported(self);
    if (plain == 1) Py_RETURN_NONE; /* kept, or nothing to keep (no call counted, as the recorder) */
    /* every other case: recorder.on_module_tensors(name, output, is_input=False) */
    PyObject *call_args[4] = {self->recorder, self->name, output, Py_False};
    return PyObject_VectorcallMethod(s_on_module_tensors, call_args, 3, s_hook_kwnames);
}

static PyObject *capture_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *name, *recorder, *rundir;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "Capture(name, recorder, rundir) takes no keyword arguments");
        return NULL;
    }
    if (!PyArg_ParseTuple(args, "UOO:Capture", &name, &recorder, &rundir)) return NULL;
    Capture *self = (Capture *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->call = capture_call;
    self->name = Py_NewRef(name);
    self->recorder = Py_NewRef(recorder);
    self->rundir = Py_NewRef(rundir);
    return (PyObject *)self;
}

static void capture_dealloc(Capture *self) {
    Py_XDECREF(self->name);
    Py_XDECREF(self->recorder);
    Py_XDECREF(self->rundir);
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
    const char *names[] = {"clone", "memory_format", "current", "entries", "calls", "nbytes", "kept", "room",
                           "sink", "copy", "_make_room", "is_cpu", "requires_grad", "on_module_tensors",
                           "is_input", "report", "dtype", "layout", "is_nested", "is_meta", "_gateless", "idle",
                           "name_filter", "_suspend_depth", "_refused_steps", "selected", "implicit", "owner",
                           "failure"};
    PyObject **slots[] = {&s_clone, &s_memory_format, &s_current, &s_entries, &s_calls, &s_nbytes, &s_kept,
                          &s_room, &s_sink, &s_copy, &s_make_room, &s_is_cpu, &s_requires_grad,
                          &s_on_module_tensors, &s_is_input, &s_report, &s_dtype, &s_layout, &s_is_nested,
                          &s_is_meta, &s_gateless, &s_idle, &s_name_filter, &s_suspend_depth,
                          &s_refused_steps, &s_selected, &s_implicit, &s_owner, &s_failure};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        if ((*slots[i] = PyUnicode_InternFromString(names[i])) == NULL) return -1;
    }
    s_clone_kwnames = PyTuple_Pack(1, s_memory_format);
    s_hook_kwnames = PyTuple_Pack(1, s_is_input);
    if (s_clone_kwnames == NULL || s_hook_kwnames == NULL) return -1;
    if ((s_index_paths[0] = PyUnicode_FromString("")) == NULL) return -1;
    for (int i = 0; i < MAX_LEAVES; i++) {
        if ((s_index_paths[i + 1] = PyUnicode_FromFormat("[%d]", i)) == NULL) return -1;
    }
    return 0;
}

/* ``*out = module.attr`` for each (module, attr, out) */
static int import_all(void) {
    struct { const char *module, *attr; PyObject **out; } wanted[] = {
        {"torch", "Tensor", &s_tensor_type},
        {"torch", "contiguous_format", &s_contiguous},
        {"torch", "strided", &s_strided},
        {"tracedump.dump.writer", "STORABLE_DTYPES", &s_storable_dtypes},
        {"tracedump.dump.suspend", "SUSPENSION", &s_suspension},
        {"tracedump.store.format", "key_text", &s_key_text},
    };
    for (size_t i = 0; i < sizeof(wanted) / sizeof(wanted[0]); i++) {
        PyObject *module = PyImport_ImportModule(wanted[i].module);
        if (module == NULL) return -1;
        *wanted[i].out = PyObject_GetAttrString(module, wanted[i].attr);
        Py_DECREF(module);
        if (*wanted[i].out == NULL) return -1;
    }
    PyObject *cuda = PyImport_ImportModule("tracedump.dump.cuda");
    PyObject *pooled = cuda == NULL ? NULL : PyObject_GetAttrString(cuda, "POOLED_FROM_BYTES");
    Py_XDECREF(cuda);
    s_pooled_from = pooled == NULL ? -1 : PyLong_AsSsize_t(pooled);
    Py_XDECREF(pooled);
    if (s_pooled_from < 0) return -1;
    if (!PyAnySet_Check(s_storable_dtypes) || !PyContextVar_CheckExact(s_suspension)) {
        PyErr_SetString(PyExc_TypeError, "STORABLE_DTYPES must be a set and SUSPENSION a ContextVar");
        return -1;
    }
    return 0;
}

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "native_hooks", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_native_hooks(void) {
    if (PyType_Ready(&KeeperType) < 0 || PyType_Ready(&CaptureType) < 0 || intern_all() < 0 || import_all() < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    if (PyModule_AddObjectRef(module, "Keeper", (PyObject *)&KeeperType) < 0 ||
        PyModule_AddObjectRef(module, "Capture", (PyObject *)&CaptureType) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
