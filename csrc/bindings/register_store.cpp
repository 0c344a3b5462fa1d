// smstore.Store: zero-copy, read-only memoryviews of records; indexing runs in raw CPython slots.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdio>

#include "error.hpp"
#include "py_store.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

// Exports a store's data section through the buffer protocol (see record_view).
struct DataExport {
    std::shared_ptr<Store> store;
};

PyTypeObject* g_store_type = nullptr;  // owned by the module

std::string hex64(uint64_t v) {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
    return buf;
}

// Raw slots: pybind11's dispatcher costs more than the whole record lookup, so store[i] and
// len(store) bypass it. The pybind11 definitions stay for introspection and explicit calls.
PyObject* store_subscript(PyObject* self, PyObject* key) {
    PyStore* s = py_store_from(self);
    return s ? s->getitem(key) : nullptr;
}

PyObject* store_item(PyObject* self, Py_ssize_t i) {
    PyObject* key = PyLong_FromSsize_t(i);
    if (!key) return nullptr;
    PyObject* r = store_subscript(self, key);
    Py_DECREF(key);
    return r;
}

Py_ssize_t store_length(PyObject* self) {
    PyStore* s = py_store_from(self);
    return s ? static_cast<Py_ssize_t>(s->size()) : -1;
}

}  // namespace

PyStore::PyStore(std::shared_ptr<Store> store) : store_(std::move(store)) {
    count_ = store_->size();
    data_size_ = store_->data_size();
    offsets_ = store_->offsets();
    owner_ = py::cast(std::make_shared<DataExport>(DataExport{store_}));
    PyObject* view = PyMemoryView_FromObject(owner_.ptr());
    if (!view) throw py::error_already_set();
    view_ = py::reinterpret_steal<py::object>(view);
}

const Store& PyStore::core() const {
    if (!store_) throw py::value_error("I/O operation on a closed smstore.Store");
    return *store_;
}

std::shared_ptr<Store> PyStore::shared() const {
    core();
    return store_;
}

py::object PyStore::metadata() const {
    if (metadata_) return metadata_;
    auto meta = core().metadata();
    try {
        py::object parsed = py::module_::import("json").attr("loads")(py::bytes(meta.data(), meta.size()));
        if (py::isinstance<py::dict>(parsed)) return metadata_ = parsed;
    } catch (py::error_already_set& e) {
        if (!e.matches(PyExc_ValueError)) throw;  // JSONDecodeError and UnicodeDecodeError are ValueErrors
    }
    throw Error(Error::Kind::Format,
                core().label() + ": corrupt metadata block (not a JSON object); run 'smstore verify' on it");
}

void PyStore::close() {
    store_.reset();
    view_ = py::none();
    owner_ = py::none();
    offsets_ = nullptr;
}

PyObject* PyStore::record(uint64_t i) const {
    if (!store_) {
        PyErr_SetString(PyExc_ValueError, "I/O operation on a closed smstore.Store");
        return nullptr;
    }
    uint64_t begin = offsets_[i], end = offsets_[i + 1];
    if (begin > end || end > data_size_) {
        set_python_error(Error(Error::Kind::Format, store_->label() + ": corrupt index: record " + std::to_string(i) +
                                                        " spans [" + std::to_string(begin) + ", " +
                                                        std::to_string(end) + ") outside the " +
                                                        std::to_string(data_size_) + "-byte data section"));
        return nullptr;
    }
    return record_view(view_.ptr(), begin, end);
}

PyObject* PyStore::getitem(PyObject* key) const {
    Py_ssize_t value;
    if (!index_value(key, &value)) return nullptr;
    Py_ssize_t i = normalize_value(value, count_);
    return i < 0 ? nullptr : record(static_cast<uint64_t>(i));
}

std::vector<uint64_t> PyStore::normalize_all(py::handle indices) const {
    std::vector<uint64_t> out;
    PyObject* seq = indices.ptr();
    if (PyList_Check(seq) || PyTuple_Check(seq)) {
        // A tuple snapshot: an item's __index__ may mutate the list it came from.
        auto items = py::reinterpret_steal<py::tuple>(PySequence_Tuple(seq));
        if (!items) throw py::error_already_set();
        out.resize(items.size());
        for (size_t k = 0; k < out.size(); ++k) {
            Py_ssize_t value;
            if (!index_value(PyTuple_GET_ITEM(items.ptr(), static_cast<Py_ssize_t>(k)), &value)) {
                throw py::error_already_set();
            }
            Py_ssize_t i = normalize_value(value, count_);
            if (i < 0) throw py::error_already_set();
            out[k] = static_cast<uint64_t>(i);
        }
        return out;
    }
    // Arrays (and other sequences, through numpy) must hold integers: a float or string index is
    // a bug in the caller, not something to round.
    py::array arr = py::array::ensure(indices);
    if (!arr) throw py::type_error("indices must be a sequence or array of integers");
    if (arr.ndim() != 1) throw py::value_error("indices must be one-dimensional");
    char kind = arr.dtype().kind();
    if (arr.size() != 0 && kind != 'i' && kind != 'u') {
        throw py::type_error("indices must be integers, not an array of dtype " +
                             py::str(arr.dtype()).cast<std::string>());
    }
    out.resize(static_cast<size_t>(arr.size()));
    if (kind == 'u' && arr.itemsize() == 8) {  // values >= 2**63 do not fit int64
        auto u = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
        const uint64_t* p = u.data();
        for (size_t k = 0; k < out.size(); ++k) {
            if (p[k] >= count_) {
                throw py::index_error("record index " + std::to_string(p[k]) + " out of range for " +
                                      std::to_string(count_) + " records");
            }
            out[k] = p[k];
        }
        return out;
    }
    auto signed_arr = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(arr);
    const int64_t* p = signed_arr.data();
    auto n = static_cast<int64_t>(count_);
    for (size_t k = 0; k < out.size(); ++k) {
        int64_t i = p[k] < 0 ? p[k] + n : p[k];
        if (i < 0 || i >= n) {
            throw py::index_error("record index " + std::to_string(p[k]) + " out of range for " +
                                  std::to_string(count_) + " records");
        }
        out[k] = static_cast<uint64_t>(i);
    }
    return out;
}

py::list PyStore::get_batch(py::handle indices) const {
    std::vector<uint64_t> idx = normalize_all(indices);  // may run Python code: look at store_ after it
    shared();                                            // raises if closed
    // Random indices miss the cache on their offsets: keep a few loads in flight ahead of use.
    constexpr size_t kAhead = 8;
    for (size_t k = 0; k < std::min(kAhead, idx.size()); ++k)
        __builtin_prefetch(offsets_ + idx[k]);
    py::list out(idx.size());
    for (size_t k = 0; k < idx.size(); ++k) {
        if (k + kAhead < idx.size()) __builtin_prefetch(offsets_ + idx[k + kAhead]);
        PyObject* r = record(idx[k]);
        if (!r) throw py::error_already_set();
        PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(k), r);
    }
    return out;
}

py::tuple PyStore::gather(py::handle indices) const {
    std::vector<uint64_t> idx = normalize_all(indices);  // may run Python code: look at store_ after it
    std::shared_ptr<Store> keep = shared();              // stays mapped while the GIL is released
    uint64_t total = keep->gather_size(idx.data(), idx.size());
    py::array_t<uint8_t> data(static_cast<py::ssize_t>(total));
    py::array_t<int64_t> offsets(static_cast<py::ssize_t>(idx.size() + 1));
    unsigned char* out = data.mutable_data();
    int64_t* out_offsets = offsets.mutable_data();
    {
        py::gil_scoped_release release;
        keep->gather(idx.data(), idx.size(), out, out_offsets);
    }
    return py::make_tuple(std::move(data), std::move(offsets));
}

PyStore* py_store_from(PyObject* obj) {
    if (!PyObject_TypeCheck(obj, g_store_type)) {
        PyErr_Format(PyExc_TypeError, "expected an smstore.Store, not %s", Py_TYPE(obj)->tp_name);
        return nullptr;
    }
    auto* inst = reinterpret_cast<py::detail::instance*>(obj);
    auto vh = inst->get_value_and_holder();
    if (!vh.holder_constructed()) {
        PyErr_SetString(PyExc_ValueError, "this smstore.Store was never initialized");
        return nullptr;
    }
    return vh.template holder<std::unique_ptr<PyStore>>().get();
}

void register_store(py::module_& m) {
    py::class_<DataExport, std::shared_ptr<DataExport>>(m, "_DataExport", py::buffer_protocol())
        .def_buffer([](DataExport& d) {
            return py::buffer_info(const_cast<unsigned char*>(d.store->data()), 1,
                                   py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(d.store->data_size())}, {static_cast<py::ssize_t>(1)},
                                   /*readonly=*/true);
        });

    auto open_path = [](const std::string& path) {
        std::shared_ptr<Store> s;
        {
            py::gil_scoped_release release;  // validating the index of a large store takes a while
            s = Store::open(path);
        }
        return PyStore(std::move(s));
    };

    py::class_<PyStore> cls(m, "Store", R"doc(A read-only, memory-mapped smstore blob.

``store[i]`` is a zero-copy, read-only ``memoryview`` of record ``i`` (negative indices count
from the end). Every view keeps the mapping alive, so views stay valid after ``close()``.

Args:
    path: The ``.smst`` file to map. Its header and offsets index are validated on open.
)doc");
    cls.def(py::init([open_path](const py::object& path) {
                return open_path(py::str(py::module_::import("os").attr("fspath")(path)));
            }),
            py::arg("path"))
        .def_static(
            "_from_fd",
            [](int fd, const std::string& label, bool full_index) {
                std::shared_ptr<Store> s;
                {
                    py::gil_scoped_release release;
                    s = std::make_shared<Store>(Mapping::map_fd(fd, label), label, full_index);
                }
                return PyStore(std::move(s));
            },
            py::arg("fd"), py::arg("label"), py::arg("full_index") = true)
        // The same as a constructor, so that Python subclasses of Store can attach to a segment.
        .def(py::init([](int fd, const std::string& label, bool full_index) {
                 std::shared_ptr<Store> s;
                 {
                     py::gil_scoped_release release;
                     s = std::make_shared<Store>(Mapping::map_fd(fd, label), label, full_index);
                 }
                 return PyStore(std::move(s));
             }),
             py::arg("fd"), py::arg("label"), py::arg("full_index"))
        .def("__len__", &PyStore::size)
        .def(
            "__getitem__",
            [](const PyStore& s, const py::object& index) {
                PyObject* r = s.getitem(index.ptr());
                if (!r) throw py::error_already_set();
                return py::reinterpret_steal<py::object>(r);
            },
            py::arg("index"))
        .def("get_batch", &PyStore::get_batch, py::arg("indices"),
             "Records at `indices` as a list of memoryviews, in one call.")
        .def("gather", &PyStore::gather, py::arg("indices"),
             "Copy the records at `indices` back to back: (uint8 data, int64 offsets of len+1).")
        .def(
            "verify",
            [](const PyStore& s) {
                auto keep = s.shared();
                py::gil_scoped_release release;
                keep->verify();
            },
            "Check the checksum over every byte; raise ChecksumMismatchError if it differs.")
        .def(
            "compute_checksum",
            [](const PyStore& s) {
                auto keep = s.shared();
                py::gil_scoped_release release;
                return hex64(keep->compute_checksum());
            },
            "XXH64 of the contents as 16 hex digits (reads every byte).")
        .def("close", &PyStore::close, "Drop this Store's mapping; records already handed out stay valid.")
        .def("__enter__", [](py::object self) { return self; })
        .def("__exit__", [](PyStore& s, const py::args&) { s.close(); })
        .def("__repr__",
             [](const PyStore& s) -> std::string {
                 if (s.closed()) return "<smstore.Store (closed)>";
                 return "<smstore.Store '" + s.core().label() + "': " + std::to_string(s.size()) + " records, " +
                        std::to_string(s.core().data_size()) + " bytes>";
             })
        .def_property_readonly("closed", &PyStore::closed)
        .def_property_readonly("path", [](const PyStore& s) { return s.core().label(); })
        .def_property_readonly("checksum", [](const PyStore& s) { return hex64(s.core().stored_checksum()); })
        .def_property_readonly("nbytes", [](const PyStore& s) { return s.core().data_size(); })
        .def_property_readonly("file_size", [](const PyStore& s) { return s.core().mapping()->size(); })
        .def_property_readonly("format_version", [](const PyStore& s) { return s.core().header().version; })
        .def_property_readonly("metadata_bytes",
                               [](const PyStore& s) {
                                   auto meta = s.core().metadata();
                                   return py::bytes(meta.data(), meta.size());
                               })
        .def_property_readonly(
            "metadata", [](const PyStore& s) { return py::module_::import("copy").attr("deepcopy")(s.metadata()); },
            "The metadata block (a fresh dict): encoding, source, created, user metadata.")
        .def_property_readonly(
            "encoding", [](const PyStore& s) { return s.metadata().attr("get")("encoding", "bytes"); },
            "How records are encoded: lines, jsonl, bytes or npy:<dtype>.")
        .def_property_readonly("offsets", [](const PyStore& s) {
            const Store& core = s.core();
            py::array_t<uint64_t> arr({static_cast<py::ssize_t>(core.size() + 1)}, {static_cast<py::ssize_t>(8)},
                                      core.offsets(), s.owner());
            arr.attr("setflags")(py::arg("write") = false);
            return arr;
        });

    m.def(
        "peek_checksum",
        [](const std::string& path) -> py::object {
            std::optional<uint64_t> checksum;
            {
                py::gil_scoped_release release;
                checksum = peek_checksum(path);
            }
            return checksum ? py::object(py::str(hex64(*checksum))) : py::object(py::none());
        },
        py::arg("path"),
        "The checksum in a blob's header (one small read, nothing validated), or None if it is no blob.");

    g_store_type = reinterpret_cast<PyTypeObject*>(cls.ptr());
    auto* heap = reinterpret_cast<PyHeapTypeObject*>(cls.ptr());
    heap->as_mapping.mp_subscript = store_subscript;
    heap->as_mapping.mp_length = store_length;
    heap->as_sequence.sq_item = store_item;
    heap->as_sequence.sq_length = store_length;
    PyType_Modified(reinterpret_cast<PyTypeObject*>(cls.ptr()));
}

}  // namespace smstore::bindings
