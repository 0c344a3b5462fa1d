// PyStore: the implementation behind smstore.Store, with store[i] and len(store) as raw CPython slots.
#include "py_store.hpp"

#include <pybind11/numpy.h>

#include <algorithm>

#include "error.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

PyTypeObject* g_store_type = nullptr;  // owned by the module

constexpr const char* kClosedMessage = "I/O operation on a closed smstore.Store";

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

py::buffer_info data_buffer(const DataExport& d) {
    return py::buffer_info(const_cast<unsigned char*>(d.store->data()), 1, py::format_descriptor<uint8_t>::format(), 1,
                           {static_cast<py::ssize_t>(d.store->data_size())}, {static_cast<py::ssize_t>(1)},
                           /*readonly=*/true);
}

PyStore::PyStore(std::shared_ptr<Store> store) : store_(std::move(store)) {
    count_ = store_->size();
    data_size_ = store_->data_size();
    offsets_ = store_->offsets();
    owner_ = py::cast(std::make_shared<DataExport>(DataExport{store_}));
    PyObject* view = PyMemoryView_FromObject(owner_.ptr());
    if (!view) throw py::error_already_set();
    view_ = py::reinterpret_steal<py::object>(view);
}

PyStore PyStore::open_path(const py::object& path) {
    std::string name = fs_path(path);
    std::shared_ptr<Store> s;
    {
        py::gil_scoped_release release;  // validating the index of a large store takes a while
        s = Store::open(name);
    }
    return PyStore(std::move(s));
}

PyStore PyStore::open_fd(int fd, const std::string& label, bool full_index) {
    std::shared_ptr<Store> s;
    {
        py::gil_scoped_release release;
        s = std::make_shared<Store>(Mapping::map_fd(fd, label), label, full_index);
    }
    return PyStore(std::move(s));
}

const Store& PyStore::core() const {
    if (!store_) throw Error(Error::Kind::Closed, kClosedMessage);
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
        // JSONDecodeError and UnicodeDecodeError are ValueErrors; a block nested deeper than the
        // parser's stack raises RecursionError: all of them mean a corrupt block.
        if (!e.matches(PyExc_ValueError) && !e.matches(PyExc_RecursionError)) throw;
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

std::string PyStore::repr() const {
    if (closed()) return "<smstore.Store (closed)>";
    return "<smstore.Store '" + store_->label() + "': " + std::to_string(count_) + " records, " +
           std::to_string(data_size_) + " bytes>";
}

bool PyStore::check_open() const {
    if (store_) return true;
    set_python_error(Error(Error::Kind::Closed, kClosedMessage));
    return false;
}

PyObject* PyStore::record(uint64_t i) const {
    if (!check_open()) return nullptr;
    uint64_t begin = offsets_[i], end = offsets_[i + 1];
    if (!Store::span_inside(begin, end, data_size_)) {
        set_python_error(store_->span_error(i, begin, end));
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
    return normalize_indices(indices, count_);
}

std::vector<uint64_t> normalize_indices(py::handle indices, uint64_t count_) {
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

void PyStore::verify() const {
    auto keep = shared();
    py::gil_scoped_release release;
    keep->verify();
}

std::string PyStore::compute_checksum() const {
    auto keep = shared();
    py::gil_scoped_release release;
    return checksum_hex(keep->compute_checksum());
}

py::object PyStore::offsets() const {
    const Store& s = core();
    py::array_t<uint64_t> arr({static_cast<py::ssize_t>(s.size() + 1)}, {static_cast<py::ssize_t>(8)}, s.offsets(),
                              owner_);
    arr.attr("setflags")(py::arg("write") = false);
    return std::move(arr);
}

PyStore* py_store_from(PyObject* obj) {
    return instance_of<PyStore>(obj, g_store_type);
}

void install_store_slots(py::handle cls) {
    g_store_type = reinterpret_cast<PyTypeObject*>(cls.ptr());
    auto* heap = reinterpret_cast<PyHeapTypeObject*>(cls.ptr());
    heap->as_mapping.mp_subscript = store_subscript;
    heap->as_mapping.mp_length = store_length;
    heap->as_sequence.sq_item = store_item;
    heap->as_sequence.sq_length = store_length;
    PyType_Modified(g_store_type);
}

}  // namespace smstore::bindings
