// smstore._core.pack_npy_lines: the C++ integer-text packer behind `smstore pack --format npy-lines`.
#include <pybind11/stl.h>

#include "npy_lines.hpp"
#include "register.hpp"
#include "writer.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

// Calls a Python progress callback from the GIL-free loop, and lets Ctrl-C cancel the pack.
class ArraysProgress : public PackProgress {
public:
    explicit ArraysProgress(py::object fn) : fn_(std::move(fn)) {}
    void update(uint64_t bytes_read) override {
        py::gil_scoped_acquire acquire;
        if (PyErr_CheckSignals() != 0) throw py::error_already_set();
        if (!fn_.is_none()) fn_(bytes_read);
    }

private:
    py::object fn_;
};

}  // namespace

void register_arrays(py::module_& m) {
    m.def(
        "pack_npy_lines",
        [](Writer& w, const std::vector<std::string>& inputs, const std::string& kind, int itemsize,
           const py::object& progress) {
            if (kind.size() != 1) throw py::value_error("kind must be 'i' or 'u'");
            IntDtype dtype{kind[0], itemsize};
            ArraysProgress cb(progress);
            py::gil_scoped_release release;
            return pack_npy_lines(w, inputs, dtype, &cb);
        },
        py::arg("writer"), py::arg("inputs"), py::arg("kind"), py::arg("itemsize"), py::arg("progress") = py::none(),
        "Pack text lines of integers into `writer`, one array record per line; returns the bytes read.");
}

}  // namespace smstore::bindings
