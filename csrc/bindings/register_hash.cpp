// smstore._core.BlobHasher: the blob checksum rule (format.hpp) fed incrementally, for a download
// that checks a blob's bytes as they arrive.
#include <cstring>
#include <mutex>

#include "format.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

// One hasher used once: finish() ends it, so a second digest can never silently cover less.
// The mutex orders update() calls made with the GIL released from different threads.
template <typename Hasher>
struct PyHasher {
    Hasher hasher;
    uint64_t fed = 0;
    bool finished = false;
    std::mutex mu;

    void check_open() const {
        if (finished) throw Error(Error::Kind::Closed, "this hasher is finished; make a new one");
    }
};
using PyBlobHasher = PyHasher<BlobHasher>;
using PyFileHasher = PyHasher<FileHasher>;

template <typename Hasher>
void update(PyHasher<Hasher>& h, const py::buffer& data) {
    py::buffer_info info = data.request();
    if (info.ndim != 1 || info.strides[0] != info.itemsize)
        throw py::value_error("update needs a contiguous 1-D buffer");
    const size_t size = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
    py::gil_scoped_release release;  // hashing a chunk of many MiB
    std::lock_guard<std::mutex> lock(h.mu);
    h.check_open();
    h.hasher.update(static_cast<const unsigned char*>(info.ptr), size);
    h.fed += size;
}

// (checksum, the header's checksum field), both as 16 hex digits.
py::tuple finish_file(PyFileHasher& h, const std::string& label) {
    std::lock_guard<std::mutex> lock(h.mu);
    h.check_open();
    uint64_t checksum = h.hasher.finish(label);
    h.finished = true;
    return py::make_tuple(checksum_hex(checksum), checksum_hex(h.hasher.stored()));
}

std::string finish(PyBlobHasher& h, const py::buffer& header) {
    py::buffer_info info = header.request();
    if (info.ndim != 1 || info.strides[0] != info.itemsize ||
        static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize) != kHeaderSize)
        throw py::value_error("BlobHasher.finish needs the blob's " + std::to_string(kHeaderSize) +
                              "-byte header as a contiguous buffer");
    std::lock_guard<std::mutex> lock(h.mu);
    h.check_open();
    h.finished = true;
    return checksum_hex(h.hasher.finish(static_cast<const unsigned char*>(info.ptr)));
}

template <typename Hasher>
uint64_t fed(PyHasher<Hasher>& h) {
    // update() writes fed under the mutex with the GIL released: read it under the mutex too, and
    // wait for a chunk being hashed without holding the GIL.
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(h.mu);
    return h.fed;
}

}  // namespace

void register_hash(py::module_& m) {
    m.attr("BLOB_HEADER_SIZE") = kHeaderSize;
    py::class_<PyBlobHasher>(m, "BlobHasher",
                             "A blob's checksum computed as its bytes stream by: update() with the bytes "
                             "after the header in file order, then finish(header).")
        .def(py::init<>())
        .def("update", checked(&update<BlobHasher>), py::arg("data"),
             "Hash the next bytes after the header, in file order.")
        .def("finish", checked(&finish), py::arg("header"),
             "Hash the header (its checksum field counts as zero) and return the checksum as 16 hex digits.")
        .def_property_readonly("fed", checked(&fed<BlobHasher>), "Bytes given to update() so far.");
    py::class_<PyFileHasher>(m, "FileHasher",
                             "A blob's checksum computed as all its bytes stream by, in file order from the "
                             "first: update() with them, then finish(label).")
        .def(py::init<>())
        .def("update", checked(&update<FileHasher>), py::arg("data"), "Hash the next bytes, in file order.")
        .def("finish", checked(&finish_file), py::arg("label"),
             "(checksum, the header's checksum field) as 16 hex digits each; errors name `label`.")
        .def_property_readonly("fed", checked(&fed<FileHasher>), "Bytes given to update() so far.");
}

}  // namespace smstore::bindings
