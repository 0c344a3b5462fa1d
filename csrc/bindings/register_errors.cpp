// The single table from core error kinds to the Python classes of smstore.errors.
#include <Python.h>

#include <cstring>

#include "error.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

struct KindClass {
    Error::Kind kind;
    const char* name;
};

constexpr KindClass kErrorTable[] = {
    {Error::Kind::Format, "StoreFormatError"},     {Error::Kind::Truncated, "StoreTruncatedError"},
    {Error::Kind::Version, "StoreVersionError"},   {Error::Kind::Checksum, "ChecksumMismatchError"},
    {Error::Kind::NotFound, "StoreNotFoundError"}, {Error::Kind::Io, "StoreIOError"},
    {Error::Kind::Input, "PackInputError"},        {Error::Kind::Shm, "SharedMemoryError"},
    {Error::Kind::Closed, "StoreClosedError"},     {Error::Kind::Index, "RecordIndexError"},
};

// Borrowed for the life of the interpreter: smstore.errors is never unloaded.
PyObject* g_classes[std::size(kErrorTable)];

// A core message names files by their bytes: one not UTF-8 is shown escaped, never lost to a
// UnicodeDecodeError in place of the error.
PyObject* message(const char* what) {
    return PyUnicode_DecodeUTF8(what, static_cast<Py_ssize_t>(std::strlen(what)), "backslashreplace");
}

}  // namespace

void set_python_error(const Error& e) {
    PyObject* cls = PyExc_RuntimeError;
    for (size_t i = 0; i < std::size(kErrorTable); ++i) {
        if (kErrorTable[i].kind == e.kind()) cls = g_classes[i];
    }
    if (e.sys_errno() &&
        PyType_IsSubtype(reinterpret_cast<PyTypeObject*>(cls), reinterpret_cast<PyTypeObject*>(PyExc_OSError))) {
        // OSError subclasses get (errno, message) so that .errno works as usual.
        PyObject* args = Py_BuildValue("(iN)", e.sys_errno(), message(e.what()));
        PyErr_SetObject(cls, args);
        Py_XDECREF(args);
        return;
    }
    PyObject* text = message(e.what());
    PyErr_SetObject(cls, text);
    Py_XDECREF(text);
}

std::string fs_path(py::handle path) {
    PyObject* bytes = nullptr;
    if (!PyUnicode_FSConverter(path.ptr(), &bytes)) throw py::error_already_set();
    auto owned = py::reinterpret_steal<py::bytes>(bytes);
    return std::string(owned);
}

py::str fs_str(const std::string& path) {
    PyObject* s = PyUnicode_DecodeFSDefaultAndSize(path.data(), static_cast<Py_ssize_t>(path.size()));
    if (!s) throw py::error_already_set();
    return py::reinterpret_steal<py::str>(s);
}

void register_errors(py::module_& m) {
    py::module_ errors = py::module_::import("smstore.errors");
    for (size_t i = 0; i < std::size(kErrorTable); ++i) {
        py::object cls = errors.attr(kErrorTable[i].name);
        g_classes[i] = cls.release().ptr();
    }
    m.attr("StoreError") = errors.attr("StoreError");
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const Error& e) {
            set_python_error(e);
        }
    });
}

}  // namespace smstore::bindings
