// smstore._core.pack_lines and pack_npy_lines: the C++ text packers behind `smstore pack`.
#include <pybind11/stl.h>

#include "npy_lines.hpp"
#include "py_writer.hpp"
#include "register.hpp"
#include "text_lines.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

// Runs pack(writer, progress) without the GIL, with `writer` marked busy and Python's progress
// callback (and Ctrl-C) reached through CallbackProgress.
template <typename Pack>
uint64_t run_packer(py::handle writer, const py::object& progress, Pack&& pack) {
    PyWriter& w = self_of<PyWriter>(writer);
    CallbackProgress cb(progress);
    PyWriter::Busy busy(w);
    py::gil_scoped_release release;
    return pack(w, &cb);
}

// Pack inputs from Python: each a file name, or a (name, start, end) part of a file.
std::vector<InputSpan> input_spans(const py::sequence& inputs) {
    if (py::isinstance<py::str>(inputs) || py::isinstance<py::bytes>(inputs)) {
        throw py::type_error("inputs must be a list of paths, not one string");
    }
    std::vector<InputSpan> spans;
    spans.reserve(inputs.size());
    for (py::handle item : inputs) {
        if (py::isinstance<py::tuple>(item)) {
            auto t = item.cast<py::tuple>();
            if (t.size() != 3) throw py::value_error("an input part is (path, start, end)");
            spans.emplace_back(fs_path(t[0]), t[1].cast<uint64_t>(), t[2].cast<uint64_t>());
        } else {
            spans.emplace_back(fs_path(item));
        }
    }
    return spans;
}

}  // namespace

void register_packers(py::module_& m) {
    m.attr("DEFAULT_MAX_LINE_BYTES") = kDefaultMaxLine;
    m.def(
        "pack_lines",
        [](py::handle writer, const py::sequence& names, const std::string& format, const py::object& progress,
           uint64_t max_line_bytes) {
            std::vector<InputSpan> inputs = input_spans(names);
            LineFormat fmt;
            if (format == "lines") {
                fmt = LineFormat::Lines;
            } else if (format == "jsonl") {
                fmt = LineFormat::Jsonl;
            } else {
                throw py::value_error("format must be 'lines' or 'jsonl', not '" + format + "'");
            }
            return run_packer(writer, progress, [&](Writer& w, PackProgress* cb) {
                return pack_lines(w, inputs, fmt, cb, max_line_bytes);
            });
        },
        py::arg("writer"), py::arg("inputs"), py::arg("format") = "lines", py::arg("progress") = py::none(),
        py::arg("max_line_bytes") = kDefaultMaxLine,
        "Pack text lines into `writer`, one record per line; returns the bytes read. Each input is a path or a "
        "(path, start, end) part of a file. A jsonl line longer than max_line_bytes is refused (plain lines "
        "stream, at any length).");
    m.def(
        "pack_npy_lines",
        [](py::handle writer, const py::sequence& names, const std::string& kind, int itemsize,
           const py::object& progress, uint64_t max_line_bytes) {
            std::vector<InputSpan> inputs = input_spans(names);
            if (kind.size() != 1) throw py::value_error("kind must be 'i' or 'u'");
            IntDtype dtype{kind[0], itemsize};
            return run_packer(writer, progress, [&](Writer& w, PackProgress* cb) {
                return pack_npy_lines(w, inputs, dtype, cb, max_line_bytes);
            });
        },
        py::arg("writer"), py::arg("inputs"), py::arg("kind"), py::arg("itemsize"), py::arg("progress") = py::none(),
        py::arg("max_line_bytes") = kDefaultMaxLine,
        "Pack text lines of integers into `writer`, one array record per line; returns the bytes read. A line "
        "longer than max_line_bytes is refused.");
}

}  // namespace smstore::bindings
