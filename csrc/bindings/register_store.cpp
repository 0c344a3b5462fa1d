// smstore._core.Store: zero-copy, read-only memoryviews of records that keep their mapping alive.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <vector>

#include "register.hpp"
#include "store.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

// Exports a store's data section through the buffer protocol. Every memoryview of a record is a
// slice of one memoryview of this object, so it holds a reference to it, and so to the mapping:
// closing or dropping the Store never leaves a view pointing at unmapped memory.
struct DataExport {
    std::shared_ptr<Store> store;
};

class PyStore {
public:
    explicit PyStore(std::shared_ptr<Store> store) : store_(std::move(store)) {
        count_ = store_->size();
        offsets_ = store_->offsets();
        owner_ = py::cast(std::make_shared<DataExport>(DataExport{store_}));
        PyObject* view = PyMemoryView_FromObject(owner_.ptr());
        if (!view) throw py::error_already_set();
        view_ = py::reinterpret_steal<py::object>(view);
    }

    const Store& core() const {
        if (!store_) throw py::value_error("I/O operation on a closed smstore.Store");
        return *store_;
    }

    std::shared_ptr<Store> shared() const {
        core();
        return store_;
    }

    uint64_t size() const { return count_; }

    uint64_t normalize(Py_ssize_t i) const {
        auto n = static_cast<Py_ssize_t>(count_);
        if (i < 0) i += n;
        if (i < 0 || i >= n) {
            throw py::index_error("record index " + std::to_string(i < 0 ? i - n : i) + " out of range for " +
                                  std::to_string(count_) + " records");
        }
        return static_cast<uint64_t>(i);
    }

    py::object record(uint64_t i) const {
        PyObject* r = PySequence_GetSlice(view_.ptr(), static_cast<Py_ssize_t>(offsets_[i]),
                                          static_cast<Py_ssize_t>(offsets_[i + 1]));
        if (!r) throw py::error_already_set();
        return py::reinterpret_steal<py::object>(r);
    }

    py::object getitem(Py_ssize_t i) const {
        core();
        return record(normalize(i));
    }

    std::vector<uint64_t> normalize_all(const py::handle& indices) const {
        core();
        std::vector<uint64_t> out;
        if (PyList_Check(indices.ptr()) || PyTuple_Check(indices.ptr())) {
            py::sequence seq = py::reinterpret_borrow<py::sequence>(indices);
            out.reserve(seq.size());
            for (auto item : seq)
                out.push_back(normalize(item.cast<Py_ssize_t>()));
            return out;
        }
        auto arr = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(indices);
        if (!arr) throw py::type_error("indices must be a sequence or array of integers");
        if (arr.ndim() != 1) throw py::value_error("indices must be one-dimensional");
        auto view = arr.unchecked<1>();
        out.reserve(static_cast<size_t>(view.shape(0)));
        for (py::ssize_t k = 0; k < view.shape(0); ++k)
            out.push_back(normalize(view(k)));
        return out;
    }

    py::list get_batch(const py::handle& indices) const {
        std::vector<uint64_t> idx = normalize_all(indices);
        py::list out(idx.size());
        for (size_t k = 0; k < idx.size(); ++k) {
            PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(k), record(idx[k]).release().ptr());
        }
        return out;
    }

    py::tuple gather(const py::handle& indices) const {
        std::vector<uint64_t> idx = normalize_all(indices);
        std::shared_ptr<Store> keep = store_;  // stays mapped while the GIL is released
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

    py::array offsets_array() const {
        const Store& s = core();
        py::array_t<uint64_t> arr({static_cast<py::ssize_t>(s.size() + 1)}, {static_cast<py::ssize_t>(8)}, s.offsets(),
                                  owner_);
        arr.attr("setflags")(py::arg("write") = false);
        return arr;
    }

    void close() {
        store_.reset();
        view_ = py::none();
        owner_ = py::none();
    }
    bool closed() const { return !store_; }

private:
    std::shared_ptr<Store> store_;
    py::object owner_;
    py::object view_;
    uint64_t count_ = 0;
    const uint64_t* offsets_ = nullptr;
};

std::string hex64(uint64_t v) {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
    return buf;
}

}  // namespace

void register_store(py::module_& m) {
    py::class_<DataExport, std::shared_ptr<DataExport>>(m, "_DataExport", py::buffer_protocol())
        .def_buffer([](DataExport& d) {
            return py::buffer_info(const_cast<unsigned char*>(d.store->data()), 1,
                                   py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(d.store->data_size())}, {static_cast<py::ssize_t>(1)},
                                   /*readonly=*/true);
        });

    py::class_<PyStore>(m, "Store", "A read-only, memory-mapped smstore blob.")
        .def(py::init([](const std::string& path) {
                 std::shared_ptr<Store> s;
                 {
                     py::gil_scoped_release release;  // validating the index of a large store takes a while
                     s = Store::open(path);
                 }
                 return PyStore(std::move(s));
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
        .def("__getitem__", &PyStore::getitem, py::arg("index"))
        .def("get_batch", &PyStore::get_batch, py::arg("indices"))
        .def("gather", &PyStore::gather, py::arg("indices"))
        .def("verify",
             [](const PyStore& s) {
                 auto keep = s.shared();
                 py::gil_scoped_release release;
                 keep->verify();
             })
        .def("compute_checksum",
             [](const PyStore& s) {
                 auto keep = s.shared();
                 py::gil_scoped_release release;
                 return hex64(keep->compute_checksum());
             })
        .def("close", &PyStore::close)
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
        .def_property_readonly("offsets", &PyStore::offsets_array);
}

}  // namespace smstore::bindings
