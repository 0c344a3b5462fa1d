// smstore.Store: the definitions; PyStore (py_store.cpp) implements them.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>

#include "py_store.hpp"
#include "register.hpp"
#include "unmapper.hpp"

namespace py = pybind11;

namespace smstore::bindings {

void register_store(py::module_& m) {
    py::class_<DataExport, std::shared_ptr<DataExport>> data_export(m, "_DataExport", py::buffer_protocol());
    data_export.def_buffer(&data_buffer);
    // Only the core creates these (py::cast bypasses tp_new); one made by _DataExport.__new__ would
    // export uninitialised memory.
    reinterpret_cast<PyTypeObject*>(data_export.ptr())->tp_new = nullptr;

    py::class_<PyStore> cls(m, "Store", R"doc(A read-only, memory-mapped smstore blob.

``store[i]`` is a zero-copy, read-only ``memoryview`` of record ``i`` (negative indices count
from the end). Every view keeps the mapping alive, so views stay valid after ``close()``.

Args:
    path: The ``.smst`` file to map. Its header and offsets index are validated on open.
)doc");
    cls.def(py::init(&PyStore::open_path), py::arg("path"))
        .def_static("_from_fd", &PyStore::open_fd, py::arg("fd"), py::arg("label"), py::arg("full_index") = true)
        // The same as a constructor, so that Python subclasses of Store can attach to a segment.
        .def(py::init(&PyStore::open_fd), py::arg("fd"), py::arg("label"), py::arg("full_index"))
        .def("__len__", checked(&PyStore::size))
        .def("__getitem__", checked(+[](const PyStore& s, const py::object& index) {
                 PyObject* r = s.getitem(index.ptr());
                 if (!r) throw py::error_already_set();
                 return py::reinterpret_steal<py::object>(r);
             }),
             py::arg("index"))
        .def("get_batch", checked(&PyStore::get_batch), py::arg("indices"),
             "Records at `indices` as a list of memoryviews, in one call.")
        .def("gather", checked(&PyStore::gather), py::arg("indices"),
             "Copy the records at `indices` back to back: (uint8 data, int64 offsets of len+1).")
        .def("verify", checked(&PyStore::verify),
             "Check the checksum over every byte; raise ChecksumMismatchError if it differs.")
        .def("compute_checksum", checked(&PyStore::compute_checksum),
             "XXH64 of the contents as 16 hex digits (reads every byte).")
        .def("close", checked(&PyStore::close), "Drop this Store's mapping; records already handed out stay valid.")
        .def("__enter__",
             [](py::handle self) {
                 self_of<PyStore>(self);
                 return py::reinterpret_borrow<py::object>(self);
             })
        .def("__exit__", checked(+[](PyStore& s, const py::args&) { s.close(); }))
        .def("__repr__", checked(&PyStore::repr))
        .def_property_readonly("closed", checked(&PyStore::closed))
        .def_property_readonly("path", checked(+[](const PyStore& s) { return fs_str(s.core().label()); }))
        .def_property_readonly("checksum",
                               checked(+[](const PyStore& s) { return checksum_hex(s.core().stored_checksum()); }))
        .def_property_readonly("nbytes", checked(+[](const PyStore& s) { return s.core().data_size(); }))
        .def_property_readonly("file_size", checked(+[](const PyStore& s) { return s.core().mapping()->size(); }))
        .def_property_readonly("format_version", checked(+[](const PyStore& s) { return s.core().header().version; }))
        .def_property_readonly("metadata_bytes", checked(+[](const PyStore& s) {
                                   auto meta = s.core().metadata();
                                   return py::bytes(meta.data(), meta.size());
                               }))
        .def_property_readonly("metadata", checked(+[](const PyStore& s) {
                                   return py::module_::import("copy").attr("deepcopy")(s.metadata());
                               }),
                               "The metadata block (a fresh dict): encoding, source, created, user metadata.")
        .def_property_readonly("encoding",
                               checked(+[](const PyStore& s) { return s.metadata().attr("get")("encoding", "bytes"); }),
                               "How records are encoded: lines, jsonl, bytes or npy:<dtype>.")
        .def_property_readonly("offsets", checked(&PyStore::offsets));
    install_store_slots(cls);

    m.def(
        "peek_checksum",
        [](const FsPath& path) -> py::object {
            std::optional<uint64_t> checksum;
            {
                py::gil_scoped_release release;
                checksum = peek_checksum(path.value);
            }
            return checksum ? py::object(py::str(checksum_hex(*checksum))) : py::object(py::none());
        },
        py::arg("path"),
        "The checksum in a blob's header (one small read, nothing validated), or None if it is no blob.");
    py::class_<Header> header(m, "BlobHeader", "A blob's validated header (read_header); the sizes are in bytes.");
    // Only read_header creates these: one made by BlobHeader.__new__ would hold no header.
    reinterpret_cast<PyTypeObject*>(header.ptr())->tp_new = nullptr;
    header.def_readonly("version", &Header::version)
        .def_readonly("file_size", &Header::file_size)
        .def_readonly("record_count", &Header::record_count)
        .def_readonly("data_offset", &Header::data_offset)
        .def_readonly("data_size", &Header::data_size)
        .def_readonly("index_offset", &Header::index_offset)
        .def_readonly("index_size", &Header::index_size)
        .def_readonly("meta_offset", &Header::meta_offset)
        .def_readonly("meta_size", &Header::meta_size)
        .def_property_readonly("checksum", [](const Header& h) { return checksum_hex(h.checksum); })
        .def_property_readonly(
            "tail_range", [](const Header& h) { return py::make_tuple(h.index_offset, tail_end(h)); },
            "(start, end): the bytes of the index and metadata, for read_tail().")
        .def("__repr__", [](const Header& h) {
            return "<BlobHeader version " + std::to_string(h.version) + ", " + std::to_string(h.record_count) +
                   " records, " + std::to_string(h.file_size) + " bytes, checksum " + checksum_hex(h.checksum) + ">";
        });
    m.attr("BLOB_MAGIC") = py::bytes(reinterpret_cast<const char*>(kMagic), sizeof kMagic);
    m.def(
        "read_header", [](const FsPath& path) { return read_header(path.value); }, py::arg("path"),
        py::call_guard<py::gil_scoped_release>(),
        "The validated header of the blob at `path` (one small read; the index and records are not read).");
    m.def("read_header_fd", &read_header_fd, py::arg("fd"), py::arg("label"), py::call_guard<py::gil_scoped_release>(),
          "read_header() of an open descriptor (the caller keeps it); errors name `label`.");
    m.def(
        "parse_header",
        [](const py::buffer& data, const std::string& label, std::optional<uint64_t> file_size) {
            py::buffer_info info = data.request();
            if (info.ndim != 1 || info.strides[0] != info.itemsize)
                throw py::value_error("parse_header needs a contiguous 1-D buffer");
            auto size = static_cast<size_t>(info.size) * static_cast<size_t>(info.itemsize);
            return parse_header(static_cast<const unsigned char*>(info.ptr), size, file_size, label);
        },
        py::arg("data"), py::arg("label"), py::arg("file_size") = py::none(),
        "The validated header in `data` (a blob's first bytes) of a blob of `file_size` bytes (default: the size "
        "the header records); errors name `label`.");
    m.def(
        "read_tail",
        [](const Header& h, const py::buffer& tail, const std::string& label) {
            py::buffer_info info = tail.request();
            if (info.ndim != 1 || info.strides[0] != info.itemsize)
                throw py::value_error("read_tail needs a contiguous 1-D buffer");
            auto size = static_cast<uint64_t>(info.size) * static_cast<uint64_t>(info.itemsize);
            py::array_t<int64_t> offsets(static_cast<py::ssize_t>(h.record_count + 1));
            // int64 and uint64 share a layout; every offset is at most data_size, below 2^63.
            auto* out = reinterpret_cast<uint64_t*>(offsets.mutable_data());
            std::string_view meta = read_tail(h, static_cast<const unsigned char*>(info.ptr), size, out, label);
            return py::make_tuple(offsets, py::bytes(meta.data(), meta.size()));
        },
        py::arg("header"), py::arg("tail"), py::arg("label"),
        "(index as int64 offsets, metadata bytes) of the blob `header` heads, from its bytes at header.tail_range; "
        "the index validated; errors name `label`.");
    m.def("blob_size", &blob_size, py::arg("record_count"), py::arg("data_size"), py::arg("meta_size") = 0,
          "Bytes of the blob the writer makes of `record_count` records of `data_size` bytes and `meta_size` bytes "
          "of metadata.");
    m.def(
        "wait_for_unmaps", [] { wait_for_unmaps(); }, py::call_guard<py::gil_scoped_release>(),
        "Wait until every mapping released so far is unmapped (large ones are unmapped by a background thread).");
}

}  // namespace smstore::bindings
