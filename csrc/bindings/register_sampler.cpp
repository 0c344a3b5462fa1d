// smstore._core: the samplers' orders (the Feistel permutation and the windowed order) over
// arrays of positions, and over a rank's strided share of a pass as a list of ints (what a DataLoader
// draws) or an int64 array (what smstore.Loader draws: no Python int per index).
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>
#include <string_view>
#include <vector>

#include "feistel.hpp"
#include "register.hpp"
#include "windowed_order.hpp"

namespace py = pybind11;

namespace smstore::bindings {

namespace {

using Positions = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;

py::array_t<int64_t> images(const Positions& positions,
                            const std::function<void(const uint64_t*, int64_t*, size_t)>& f) {
    if (positions.ndim() != 1) throw py::value_error("positions must be a 1-D array");
    auto count = static_cast<size_t>(positions.size());
    py::array_t<int64_t> out(static_cast<py::ssize_t>(count));
    f(positions.data(), out.mutable_data(), count);
    return out;
}

}  // namespace

py::list to_list(const std::vector<int64_t>& values) {
    py::list out(values.size());
    for (size_t i = 0; i < values.size(); ++i) {
        PyObject* v = PyLong_FromLongLong(values[i]);
        if (v == nullptr) throw py::error_already_set();
        PyList_SET_ITEM(out.ptr(), static_cast<py::ssize_t>(i), v);
    }
    return out;
}

void register_sampler(py::module_& m) {
    m.def(
        "feistel_round_keys",
        [](const py::bytes& key, unsigned rounds) {
            return feistel_round_keys(static_cast<std::string_view>(key), rounds);
        },
        py::arg("key"), py::arg("rounds") = 6,
        "A Feistel permutation's round keys: 64-bit little-endian words of BLAKE2b(key, person=b'smstore-feistel').");
    m.def(
        "feistel_permute",
        [](const Positions& positions, uint64_t n, std::vector<uint64_t> round_keys) {
            Feistel perm(n, std::move(round_keys));
            return images(positions, [&](const uint64_t* in, int64_t* out, size_t count) {
                for (size_t i = 0; i < count; ++i) {
                    if (in[i] >= n) {
                        throw py::index_error("position " + std::to_string(in[i]) +
                                              " out of range for a permutation of " + std::to_string(n));
                    }
                }
                py::gil_scoped_release release;
                perm.apply(in, out, count);
            });
        },
        py::arg("positions"), py::arg("n"), py::arg("round_keys"),
        "The images of positions (a 1-D array, each < n) under the keyed Feistel permutation of [0, n), as int64.");
    m.def(
        "feistel_strided",
        [](uint64_t n, std::vector<uint64_t> round_keys, uint64_t first, uint64_t step, size_t count, uint64_t wrap) {
            Feistel perm(n, std::move(round_keys));
            std::vector<int64_t> out(count);
            feistel_strided(perm, first, step, count, wrap, out.data());
            return to_list(out);
        },
        py::arg("n"), py::arg("round_keys"), py::arg("first"), py::arg("step"), py::arg("count"), py::arg("wrap"),
        "The images of positions (first + i * step) % wrap, i < count, under the Feistel permutation of [0, n).");
    m.def(
        "feistel_strided_array",
        [](uint64_t n, std::vector<uint64_t> round_keys, uint64_t first, uint64_t step, size_t count, uint64_t wrap) {
            Feistel perm(n, std::move(round_keys));
            py::array_t<int64_t> out(static_cast<py::ssize_t>(count));
            int64_t* dst = out.mutable_data();
            {
                py::gil_scoped_release release;
                feistel_strided(perm, first, step, count, wrap, dst);
            }
            return out;
        },
        py::arg("n"), py::arg("round_keys"), py::arg("first"), py::arg("step"), py::arg("count"), py::arg("wrap"),
        "feistel_strided's images as an int64 array.");

    py::class_<WindowedOrder, std::shared_ptr<WindowedOrder>>(
        m, "WindowedOrder", "The windowed epoch order's tables (smstore.sampler.WindowedOrder evaluates with it).")
        .def(py::init([](std::vector<uint64_t> window_starts, std::vector<uint64_t> seq_starts,
                         std::vector<uint64_t> record_starts, size_t window,
                         std::function<std::vector<uint64_t>(size_t)> keys) {
                 return WindowedOrder(std::move(window_starts), std::move(seq_starts), std::move(record_starts), window,
                                      std::move(keys));
             }),
             py::arg("window_starts"), py::arg("seq_starts"), py::arg("record_starts"), py::arg("window"),
             py::arg("keys"))
        .def("__len__", &WindowedOrder::size)
        .def("__call__",
             [](WindowedOrder& o, const Positions& positions) {
                 return images(positions,
                               [&](const uint64_t* in, int64_t* out, size_t count) { o.apply(in, out, count); });
             })
        .def(
            "strided",
            [](WindowedOrder& o, uint64_t first, uint64_t step, size_t count, uint64_t wrap) {
                std::vector<int64_t> out(count);
                o.strided(first, step, count, wrap, out.data());
                return to_list(out);
            },
            py::arg("first"), py::arg("step"), py::arg("count"), py::arg("wrap"))
        .def(
            "strided_array",
            [](WindowedOrder& o, uint64_t first, uint64_t step, size_t count, uint64_t wrap) {
                py::array_t<int64_t> out(static_cast<py::ssize_t>(count));
                o.strided(first, step, count, wrap, out.mutable_data());
                return out;
            },
            py::arg("first"), py::arg("step"), py::arg("count"), py::arg("wrap"));
}

}  // namespace smstore::bindings
