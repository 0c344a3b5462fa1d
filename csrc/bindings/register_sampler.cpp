// smstore._core.feistel_permute: the samplers' permutation over an array of positions.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <string>

#include "feistel.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {

void register_sampler(py::module_& m) {
    m.def(
        "feistel_permute",
        [](py::array_t<uint64_t, py::array::c_style | py::array::forcecast> positions, uint64_t n,
           std::vector<uint64_t> round_keys) {
            if (positions.ndim() != 1) throw py::value_error("positions must be a 1-D array");
            Feistel perm(n, std::move(round_keys));
            const uint64_t* data = positions.data();
            auto count = static_cast<size_t>(positions.size());
            for (size_t i = 0; i < count; ++i) {
                if (data[i] >= n) {
                    throw py::index_error("position " + std::to_string(data[i]) +
                                          " out of range for a permutation of " + std::to_string(n));
                }
            }
            py::array_t<int64_t> out(static_cast<py::ssize_t>(count));
            int64_t* dst = out.mutable_data();
            {
                py::gil_scoped_release release;
                perm.apply(data, dst, count);
            }
            return out;
        },
        py::arg("positions"), py::arg("n"), py::arg("round_keys"),
        "The images of positions (a 1-D array, each < n) under the keyed Feistel permutation of [0, n), as int64.");
}

}  // namespace smstore::bindings
