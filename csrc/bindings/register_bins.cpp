// smstore._core.pack_lengths and count_bins: PackedBins' packer (packing.hpp) over int64 arrays,
// the GIL released while it runs.
#include <pybind11/numpy.h>

#include <algorithm>
#include <string>
#include <utility>

#include "packing.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {

using Lengths = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Int64s = py::array_t<int64_t>;

void register_bins(py::module_& m) {
    m.def(
        "pack_lengths",
        [](const Lengths& lengths, int64_t length, int64_t open_bins, const std::string& algorithm,
           const std::string& close) {
            const PackRule rule = PackRule::parse(length, open_bins, algorithm, close);
            const size_t count = flat_size(lengths, "lengths");
            const int64_t* in = lengths.data();
            Packing packing;
            {
                py::gil_scoped_release release;
                packing = pack_lengths(in, count, rule);
            }
            const auto rows = static_cast<py::ssize_t>(packing.segments.size() / 3);
            Int64s segments({rows, py::ssize_t{3}});
            Int64s starts(static_cast<py::ssize_t>(packing.starts.size()));
            std::copy(packing.segments.begin(), packing.segments.end(), segments.mutable_data());
            std::copy(packing.starts.begin(), packing.starts.end(), starts.mutable_data());
            return std::make_pair(std::move(segments), std::move(starts));
        },
        py::arg("lengths"), py::arg("length"), py::kw_only(), py::arg("open_bins"), py::arg("algorithm"),
        py::arg("close"),
        "(segments, starts): documents of `lengths` packed in their order into bins of `length` tokens "
        "(smstore.read.packing.pack_lengths).");
    m.def(
        "count_bins",
        [](const Lengths& lengths, int64_t group, int64_t length, int64_t open_bins, const std::string& algorithm,
           const std::string& close) {
            const PackRule rule = PackRule::parse(length, open_bins, algorithm, close);
            if (group < 1) throw py::value_error("group must be at least 1, not " + std::to_string(group));
            const size_t count = flat_size(lengths, "lengths");
            const auto size = static_cast<size_t>(group);
            Int64s out(static_cast<py::ssize_t>(count / size + (count % size != 0)));
            const int64_t* in = lengths.data();
            int64_t* dst = out.mutable_data();
            {
                py::gil_scoped_release release;
                count_bins(in, count, size, rule, dst);
            }
            return out;
        },
        py::arg("lengths"), py::arg("group"), py::kw_only(), py::arg("length"), py::arg("open_bins"),
        py::arg("algorithm"), py::arg("close"),
        "The bins of each group of `group` consecutive documents of `lengths`, each packed on its own.");
}

}  // namespace smstore::bindings
