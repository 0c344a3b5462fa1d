// The Python-facing Store object shared by the Store bindings and the Dataset fast path.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>
#include <string>
#include <vector>

#include "store.hpp"

namespace smstore::bindings {

// A zero-copy record: a view of bytes [begin, end) of `view`, the 1-D memoryview of a store's
// data section. PyMemoryView_FromObject(view) registers a new view on the same managed buffer,
// which holds the exporting object and so the mapping: no record can outlive the memory it
// points into. The new view is ours alone until returned, so we narrow it in place exactly as
// CPython's memoryview slicing does (init_slice), without building two ints and a slice object.
inline PyObject* record_view(PyObject* view, uint64_t begin, uint64_t end) {
    PyObject* record = PyMemoryView_FromObject(view);
    if (!record) return nullptr;
    Py_buffer* buf = PyMemoryView_GET_BUFFER(record);
    buf->buf = static_cast<char*>(buf->buf) + begin;
    buf->len = static_cast<Py_ssize_t>(end - begin);
    buf->shape[0] = buf->len;
    return record;
}

// The integer value of an index object. This may run Python code (__index__), which may close or
// rebind stores: callers do it before they look at any store state. False with an error set.
inline bool index_value(PyObject* key, Py_ssize_t* out) {
    Py_ssize_t i = PyLong_CheckExact(key) ? PyLong_AsSsize_t(key) : PyNumber_AsSsize_t(key, PyExc_IndexError);
    if (i == -1 && PyErr_Occurred()) {
        // An int beyond Py_ssize_t is still just outside the store: IndexError, as list does.
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_IndexError, "cannot fit 'int' into an index-sized integer");
        }
        return false;
    }
    *out = i;
    return true;
}

// Python semantics for an index value: negative counts from the end; -1 with IndexError set if outside.
inline Py_ssize_t normalize_value(Py_ssize_t i, uint64_t count) {
    auto n = static_cast<Py_ssize_t>(count);
    Py_ssize_t j = i < 0 ? i + n : i;
    if (j < 0 || j >= n) {
        PyErr_Format(PyExc_IndexError, "record index %zd out of range for %zd records", i, n);
        return -1;
    }
    return j;
}

// Python indices (a list, tuple or integer array; negative counts from the end) as record numbers
// below `count`. Throws IndexError, TypeError or ValueError.
std::vector<uint64_t> normalize_indices(pybind11::handle indices, uint64_t count);

// Exports a store's data section through the buffer protocol (see record_view).
struct DataExport {
    std::shared_ptr<Store> store;
};
pybind11::buffer_info data_buffer(const DataExport& d);

class PyStore {
public:
    explicit PyStore(std::shared_ptr<Store> store);
    // smstore.Store(path): maps and validates the file without the GIL.
    static PyStore open_path(const pybind11::object& path);
    // A Store over an open descriptor (a daemon's segment); the caller keeps the fd.
    static PyStore open_fd(int fd, const std::string& label, bool full_index);

    const Store& core() const;  // StoreClosedError when closed
    std::shared_ptr<Store> shared() const;
    uint64_t size() const noexcept { return count_; }
    bool closed() const noexcept { return !store_; }
    // False with StoreClosedError set when closed (for raw CPython code, which cannot throw).
    bool check_open() const;
    const pybind11::object& owner() const noexcept { return owner_; }
    // The offsets index (nullptr when closed) and the data section's size.
    const uint64_t* index() const noexcept { return offsets_; }
    uint64_t data_bytes() const noexcept { return data_size_; }
    // The parsed metadata block, parsed once (a dict; callers must not mutate it).
    pybind11::object metadata() const;
    void close();
    std::string repr() const;

    // Record i (i < size()) as a new reference, or nullptr with a Python error set:
    // StoreClosedError when closed, StoreFormatError when its offsets leave the data section. The
    // check costs two compares and makes every read safe even where the index was not scanned in
    // full (daemon segments).
    PyObject* record(uint64_t i) const;
    // store[key]: new reference, or nullptr with a Python error set.
    PyObject* getitem(PyObject* key) const;
    std::vector<uint64_t> normalize_all(pybind11::handle indices) const;
    pybind11::list get_batch(pybind11::handle indices) const;
    pybind11::tuple gather(pybind11::handle indices) const;
    void verify() const;                   // without the GIL
    std::string compute_checksum() const;  // without the GIL
    pybind11::object offsets() const;      // a read-only uint64 array over the mapped index

private:
    std::shared_ptr<Store> store_;
    pybind11::object owner_;
    pybind11::object view_;
    mutable pybind11::object metadata_;
    uint64_t count_ = 0;
    uint64_t data_size_ = 0;
    const uint64_t* offsets_ = nullptr;
};

// The PyStore inside a Python Store object, or nullptr with a Python error set (see instance_of).
PyStore* py_store_from(PyObject* obj);

// Installs raw CPython slots for store[i] and len(store) on the Store class (see py_store.cpp).
void install_store_slots(pybind11::handle cls);

}  // namespace smstore::bindings
