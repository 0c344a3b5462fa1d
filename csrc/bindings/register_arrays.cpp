// smstore._core.pack_npy_lines: the C++ integer-text packer behind `smstore pack --format npy-lines`.
#include <pybind11/stl.h>

#include "npy_lines.hpp"
#include "py_writer.hpp"
#include "register.hpp"
#include "writer.hpp"

namespace py = pybind11;

namespace smstore::bindings {

void register_arrays(py::module_& m) {
    m.def(
        "pack_npy_lines",
        [](PyWriter& w, const std::vector<std::string>& inputs, const std::string& kind, int itemsize,
           const py::object& progress) {
            if (kind.size() != 1) throw py::value_error("kind must be 'i' or 'u'");
            IntDtype dtype{kind[0], itemsize};
            CallbackProgress cb(progress);
            PyWriter::Busy busy(w);
            py::gil_scoped_release release;
            return pack_npy_lines(w, inputs, dtype, &cb);
        },
        py::arg("writer"), py::arg("inputs"), py::arg("kind"), py::arg("itemsize"), py::arg("progress") = py::none(),
        "Pack text lines of integers into `writer`, one array record per line; returns the bytes read.");
}

}  // namespace smstore::bindings
