// smstore._core.RecordReader: the C base of SharedStoreDataset, so ds[i] never enters a Python frame.

#include "error.hpp"
#include "py_sharded.hpp"
#include "py_store.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

// Holds what ds[i] needs, borrowed from a bound Store. Python subclasses add __dict__ and
// implement _attach() (called on first access in a process that has not bound a Store yet).
struct RecordReader {
    PyObject_HEAD PyObject* store;  // the bound smstore.Store or ShardedStore, or nullptr
    PyStore* core;                  // its C++ object (alive while we hold `store`), for a Store
    PyShardedStore* sharded;        // or this, for a ShardedStore
    PyObject* decode;               // callable or nullptr
    PyObject* transform;            // callable or nullptr
};

int reader_clear(PyObject* self) {
    auto* r = reinterpret_cast<RecordReader*>(self);
    r->core = nullptr;
    r->sharded = nullptr;
    Py_CLEAR(r->store);
    Py_CLEAR(r->decode);
    Py_CLEAR(r->transform);
    return 0;
}

int reader_traverse(PyObject* self, visitproc visit, void* arg) {
    auto* r = reinterpret_cast<RecordReader*>(self);
    Py_VISIT(Py_TYPE(self));
    Py_VISIT(r->store);
    Py_VISIT(r->decode);
    Py_VISIT(r->transform);
    return 0;
}

void reader_dealloc(PyObject* self) {
    PyTypeObject* type = Py_TYPE(self);  // instances of heap types own a reference to their type
    PyObject_GC_UnTrack(self);
    reader_clear(self);
    type->tp_free(self);
    Py_DECREF(type);
}

// Calls fn(arg) and drops arg; nullptr (with the error set) if arg is nullptr or the call fails.
PyObject* apply(PyObject* fn, PyObject* arg) {
    if (!arg || !fn) return arg;
    PyObject* out = PyObject_CallOneArg(fn, arg);
    Py_DECREF(arg);
    return out;
}

PyObject* reader_subscript(PyObject* self, PyObject* key) {
    auto* r = reinterpret_cast<RecordReader*>(self);
    // __index__, _attach(), decode and transform are Python code that may rebind or unbind this
    // reader: run the index first, then read the binding, and call the callables through our own
    // references.
    Py_ssize_t value;
    if (!index_value(key, &value)) return nullptr;
    if (!r->core && !r->sharded) {
        PyObject* done = PyObject_CallMethod(self, "_attach", nullptr);
        if (!done) return nullptr;
        Py_DECREF(done);
        if (!r->core && !r->sharded) {
            PyErr_SetString(PyExc_RuntimeError, "_attach() did not bind a Store");
            return nullptr;
        }
    }
    PyObject* record;
    if (r->core) {
        Py_ssize_t i = normalize_value(value, r->core->size());
        if (i < 0) return nullptr;
        record = r->core->record(static_cast<uint64_t>(i));
    } else {
        PyShardedStore* sharded = r->sharded;
        if (!sharded->check_open()) return nullptr;
        Py_ssize_t i = normalize_value(value, sharded->size());
        if (i < 0) return nullptr;
        auto [k, j] = sharded->locate(static_cast<uint64_t>(i));
        if (sharded->is_open(k)) {
            record = sharded->open_record(k, j);
        } else {
            // Opening the shard runs Python code (the opener) that may rebind this reader: hold the store.
            PyObject* store = Py_NewRef(r->store);
            record = sharded->record(static_cast<uint64_t>(i));
            Py_DECREF(store);
        }
        if (!record) return nullptr;
    }
    PyObject* decode = Py_XNewRef(r->decode);
    PyObject* transform = Py_XNewRef(r->transform);
    record = apply(transform, apply(decode, record));
    Py_XDECREF(decode);
    Py_XDECREF(transform);
    return record;
}

// _bind(store, decode, transform): read records of `store`, passing them through the callables.
PyObject* reader_bind(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "_bind(store, decode, transform) takes 3 arguments");
        return nullptr;
    }
    PyStore* s = nullptr;
    PyShardedStore* sharded = nullptr;
    if (is_sharded(args[0])) {
        sharded = py_sharded_from(args[0]);
        if (!sharded || !sharded->check_open()) return nullptr;
    } else {
        s = py_store_from(args[0]);
        if (!s || !s->check_open()) return nullptr;
    }
    for (Py_ssize_t k = 1; k < 3; ++k) {
        if (args[k] != Py_None && !PyCallable_Check(args[k])) {
            PyErr_SetString(PyExc_TypeError, "decode and transform must be callables or None");
            return nullptr;
        }
    }
    auto* r = reinterpret_cast<RecordReader*>(self);
    reader_clear(self);
    r->store = Py_NewRef(args[0]);
    r->core = s;
    r->sharded = sharded;
    r->decode = args[1] == Py_None ? nullptr : Py_NewRef(args[1]);
    r->transform = args[2] == Py_None ? nullptr : Py_NewRef(args[2]);
    Py_RETURN_NONE;
}

// The base class binds nothing itself: say so (SharedStoreDataset overrides this).
PyObject* reader_attach(PyObject*, PyObject*) {
    set_python_error(
        Error(Error::Kind::Closed,
              "this RecordReader is bound to no Store: _bind() one first, or use smstore.SharedStoreDataset"));
    return nullptr;
}

PyObject* reader_unbind(PyObject* self, PyObject*) {
    reader_clear(self);
    Py_RETURN_NONE;
}

PyObject* reader_bound_store(PyObject* self, void*) {
    auto* r = reinterpret_cast<RecordReader*>(self);
    return Py_NewRef(r->store ? r->store : Py_None);
}

PyMethodDef reader_methods[] = {
    {"_bind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(reader_bind)), METH_FASTCALL,
     "_bind(store, decode, transform): serve records of `store` (a Store or ShardedStore) through the given "
     "callables."},
    {"_unbind", reader_unbind, METH_NOARGS, "Forget the bound Store (the next access calls _attach())."},
    {"_attach", reader_attach, METH_NOARGS, "Bind a Store on first access; subclasses implement it."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef reader_getset[] = {
    {"_bound_store", reader_bound_store, nullptr, "The bound Store, or None.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot reader_slots[] = {
    {Py_tp_doc, const_cast<char*>("Base of SharedStoreDataset: self[i] reads record i of the bound Store in C.")},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_dealloc, reinterpret_cast<void*>(reader_dealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(reader_traverse)},
    {Py_tp_clear, reinterpret_cast<void*>(reader_clear)},
    {Py_mp_subscript, reinterpret_cast<void*>(reader_subscript)},
    {Py_tp_methods, reader_methods},
    {Py_tp_getset, reader_getset},
    {0, nullptr},
};

PyType_Spec reader_spec = {
    "smstore._core.RecordReader",
    sizeof(RecordReader),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    reader_slots,
};

}  // namespace

void register_record_reader(py::module_& m) {
    PyObject* type = PyType_FromSpec(&reader_spec);
    if (!type) throw py::error_already_set();
    m.add_object("RecordReader", py::reinterpret_steal<py::object>(type));
}

}  // namespace smstore::bindings
