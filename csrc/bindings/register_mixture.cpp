// smstore._core: the mixture's split tree and epoch order over arrays of positions (the GIL
// released while they run), and over a rank's strided share of a pass as a list of ints.
#include <pybind11/functional.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <utility>
#include <vector>

#include "mixture.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {

namespace {

using Positions = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using Int64s = py::array_t<int64_t>;

// Two int64 arrays the size of positions, filled by f(in, first, second, count) without the GIL.
template <class F>
std::pair<Int64s, Int64s> two_arrays(const Positions& positions, F&& f) {
    size_t count = flat_size(positions, "positions");
    Int64s first(static_cast<py::ssize_t>(count)), second(static_cast<py::ssize_t>(count));
    const uint64_t* in = positions.data();
    int64_t* x = first.mutable_data();
    int64_t* y = second.mutable_data();
    {
        py::gil_scoped_release release;
        f(in, x, y, count);
    }
    return {std::move(first), std::move(second)};
}

}  // namespace

void register_mixture(py::module_& m) {
    py::class_<MixtureTree>(m, "MixtureTree", "A mixture's split tree (smstore.mixture.Mixture builds it).")
        .def(py::init<const std::vector<uint64_t>&, const std::vector<uint64_t>&, const std::vector<int64_t>&,
                      const std::vector<int64_t>&, int64_t, size_t>(),
             py::arg("a"), py::arg("q"), py::arg("left"), py::arg("right"), py::arg("root"), py::arg("sources"))
        .def(
            "locate",
            [](const MixtureTree& t, const Positions& positions) {
                return two_arrays(positions, [&](const uint64_t* in, int64_t* src, int64_t* before, size_t n) {
                    t.locate(in, src, before, n);
                });
            },
            py::arg("positions"),
            "(source, draws of that source before the position) for each position (< 2**63), as int64 arrays.");

    py::class_<MixtureOrder>(m, "MixtureOrder", "A mixture epoch's order (smstore.mixture.MixtureOrder uses it).")
        .def(py::init([](const MixtureTree& tree, std::vector<uint64_t> lengths, std::vector<uint64_t> offsets,
                         uint64_t size, MixtureOrder::KeySource keys) {
                 return std::make_unique<MixtureOrder>(tree, std::move(lengths), std::move(offsets), size,
                                                       std::move(keys));
             }),
             py::arg("tree"), py::arg("lengths"), py::arg("offsets"), py::arg("size"), py::arg("keys"))
        .def(py::init([](const MixtureTree& tree, std::vector<uint64_t> lengths, std::vector<uint64_t> offsets,
                         uint64_t size, MixtureOrder::WindowedSource windows) {
                 return std::make_unique<MixtureOrder>(tree, std::move(lengths), std::move(offsets), size,
                                                       std::move(windows));
             }),
             py::arg("tree"), py::arg("lengths"), py::arg("offsets"), py::arg("size"), py::kw_only(),
             py::arg("windows"))
        .def("__len__", &MixtureOrder::size)
        .def(
            "pairs",
            [](MixtureOrder& o, const Positions& positions) {
                return two_arrays(positions, [&](const uint64_t* in, int64_t* src, int64_t* local, size_t n) {
                    o.pairs(in, src, local, n);
                });
            },
            py::arg("positions"))
        .def(
            "__call__",
            [](MixtureOrder& o, const Positions& positions) {
                size_t count = flat_size(positions, "positions");
                Int64s out(static_cast<py::ssize_t>(count));
                const uint64_t* in = positions.data();
                int64_t* dst = out.mutable_data();
                {
                    py::gil_scoped_release release;
                    o.apply(in, dst, count);
                }
                return out;
            },
            py::arg("positions"))
        .def(
            "strided",
            [](MixtureOrder& o, uint64_t first, uint64_t step, size_t count, uint64_t wrap) {
                std::vector<int64_t> out(count);
                {
                    py::gil_scoped_release release;
                    o.strided(first, step, count, wrap, out.data());
                }
                return to_list(out);
            },
            py::arg("first"), py::arg("step"), py::arg("count"), py::arg("wrap"))
        .def(
            "strided_array",
            [](MixtureOrder& o, uint64_t first, uint64_t step, size_t count, uint64_t wrap) {
                Int64s out(static_cast<py::ssize_t>(count));
                int64_t* dst = out.mutable_data();
                {
                    py::gil_scoped_release release;
                    o.strided(first, step, count, wrap, dst);
                }
                return out;
            },
            py::arg("first"), py::arg("step"), py::arg("count"), py::arg("wrap"));
}

}  // namespace smstore::bindings
