// smstore._core.Writer: the streaming writer behind smstore.Writer and every packer.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include "error.hpp"
#include "py_writer.hpp"
#include "register.hpp"
#include "writer.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

// Appends one record from bytes, str (UTF-8) or any C-contiguous buffer.
void append_object(Writer& w, const py::handle& obj) {
    PyObject* o = obj.ptr();
    if (PyBytes_Check(o)) {
        w.append(PyBytes_AS_STRING(o), static_cast<size_t>(PyBytes_GET_SIZE(o)));
        return;
    }
    if (PyUnicode_Check(o)) {
        Py_ssize_t n;
        const char* p = PyUnicode_AsUTF8AndSize(o, &n);
        if (!p) throw py::error_already_set();
        w.append(p, static_cast<size_t>(n));
        return;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(o, &view, PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        throw py::type_error(std::string("a record must be bytes, str or a contiguous buffer, not ") +
                             Py_TYPE(o)->tp_name);
    }
    try {
        w.append(view.buf, static_cast<size_t>(view.len));
    } catch (...) {
        PyBuffer_Release(&view);
        throw;
    }
    PyBuffer_Release(&view);
}

// Records given as one buffer and their offsets into it (Arrow's binary and string layout).
template <typename T>
uint64_t append_spans(PyWriter& w, const unsigned char* data, uint64_t size, const T* off, size_t n) {
    for (size_t i = 0; i + 1 < n; ++i) {
        if (off[i] < 0 || off[i + 1] < off[i] || static_cast<uint64_t>(off[i + 1]) > size) {
            throw Error(Error::Kind::Input, w.path() + ": offsets[" + std::to_string(i) + ":" + std::to_string(i + 2) +
                                                "] do not lie within the data buffer in order");
        }
    }
    py::gil_scoped_release release;
    for (size_t i = 0; i + 1 < n; ++i)
        w.append(data + off[i], static_cast<size_t>(off[i + 1] - off[i]));
    return n ? n - 1 : 0;
}

uint64_t extend_offsets(PyWriter& w, const py::buffer& data, const py::array& offsets) {
    PyWriter::Busy busy(w);
    py::buffer_info d = data.request();
    if (d.ndim > 1 || (d.ndim == 1 && d.strides[0] != 1 && d.shape[0] > 1) || d.itemsize != 1) {
        throw py::type_error("data must be a contiguous buffer of bytes");
    }
    auto size = static_cast<uint64_t>(d.size);
    auto* bytes = static_cast<const unsigned char*>(d.ptr);
    if (offsets.ndim() != 1) throw py::value_error("offsets must be one-dimensional");
    char kind = offsets.dtype().kind();
    if (kind != 'i' && kind != 'u') throw py::type_error("offsets must be an integer array");
    if (py::isinstance<py::array_t<int32_t>>(offsets)) {
        auto o = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(offsets);
        return append_spans(w, bytes, size, o.data(), static_cast<size_t>(o.size()));
    }
    auto o = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(offsets);
    if (!o) throw py::type_error("offsets must be an integer array");
    return append_spans(w, bytes, size, o.data(), static_cast<size_t>(o.size()));
}

}  // namespace

void register_writer(py::module_& m) {
    py::class_<PyWriter>(m, "Writer", "Streams records into a new blob; nothing is visible until finish().")
        .def(py::init([](const FsPath& path, bool durable, uint64_t item_size) {
                 return std::make_unique<PyWriter>(path.value, durable, item_size);
             }),
             py::arg("path"), py::arg("durable") = true, py::arg("item_size") = 1)
        .def_static(
            "to_fd", [](int fd, std::string label) { return std::make_unique<PyWriter>(fd, std::move(label)); },
            py::arg("fd"), py::arg("label"),
            "A writer into an empty file descriptor (e.g. a memfd), which it owns until finish_fd() returns it.")
        .def("append", checked(+[](PyWriter& w, const py::handle& record) {
                 w.check_idle();
                 append_object(w, record);
             }),
             py::arg("record"))
        .def("extend", checked(+[](PyWriter& w, const py::iterable& records) {
                 uint64_t before = w.record_count();
                 for (auto item : records) {
                     w.check_idle();  // the iterable is Python code: it may have handed w to a thread
                     append_object(w, item);
                 }
                 return w.record_count() - before;
             }),
             py::arg("records"))
        .def("extend_offsets", checked(&extend_offsets), py::arg("data"), py::arg("offsets"),
             "Append records data[offsets[i]:offsets[i+1]] for every i, in one call without the GIL: the "
             "layout of an Arrow binary or string array (offsets: int32 or int64, non-decreasing, within data).")
        .def("finish", checked(+[](PyWriter& w, const std::string& metadata_json) {
                 PyWriter::Busy busy(w);
                 py::gil_scoped_release release;
                 w.finish(metadata_json);
             }),
             py::arg("metadata_json"))
        .def("finish_fd", checked(+[](PyWriter& w, const std::string& metadata_json) {
                 PyWriter::Busy busy(w);
                 py::gil_scoped_release release;
                 return w.finish_fd(metadata_json);
             }),
             py::arg("metadata_json"), "Complete the blob and return its file descriptor (now the caller's).")
        .def("abort", checked(+[](PyWriter& w) {
                 w.check_idle();
                 w.abort();
             }))
        .def_property_readonly("record_count", checked(+[](const PyWriter& w) { return w.record_count(); }))
        .def_property_readonly("data_size", checked(+[](const PyWriter& w) { return w.data_size(); }))
        .def_property_readonly("path", checked(+[](const PyWriter& w) { return fs_str(w.path()); }))
        .def_property_readonly("is_open", checked(+[](const PyWriter& w) { return w.is_open(); }));
}

}  // namespace smstore::bindings
