// smstore._core shared-memory functions: what the daemon needs to load, size and unlink segments.
#include <algorithm>
#include <cstring>
#include <string_view>

#include "format.hpp"
#include "register.hpp"
#include "shm.hpp"

namespace py = pybind11;

namespace smstore::bindings {

void register_shm(py::module_& m) {
    m.attr("SHM_DIR") = kShmDir;
    m.def(
        "shm_space",
        [](const FsPath& dir) {
            ShmSpace s = shm_space(dir.value);
            return py::make_tuple(s.available, s.total);
        },
        py::arg("dir") = kShmDir, "(available, total) bytes of the filesystem holding shared memory.");
    m.def(
        "shm_load",
        [](const FsPath& path, const std::string& name, unsigned mode, int64_t gid, uint64_t room_limit,
           uint64_t max_rate, bool hash_thread) {
            LoadOptions opt;
            opt.max_rate = max_rate;
            opt.hash_thread = hash_thread;
            opt.mode = static_cast<mode_t>(mode);
            opt.gid = gid;
            opt.room_limit = room_limit;
            LoadedSegment seg;
            {
                py::gil_scoped_release release;
                seg = load_segment(path.value, name, opt);
            }
            return py::make_tuple(seg.fd, seg.size, checksum_hex(seg.checksum), seg.record_count);
        },
        py::arg("path"), py::arg("name"), py::arg("mode") = 0400, py::arg("gid") = -1, py::arg("room_limit") = 0,
        py::arg("max_rate") = 0, py::arg("hash_thread") = true,
        "Load a blob into a new segment; returns (read-only fd, size, checksum as hex, record_count).");
    m.def("shm_create", &create_segment, py::arg("name"),
          "Create segment `name` (O_EXCL, writable by its owner only until shm_seal); returns its descriptor.");
    m.def(
        "shm_seal",
        [](int fd, const std::string& name, unsigned mode, int64_t gid) {
            return seal_segment(fd, name, static_cast<mode_t>(mode), gid);
        },
        py::arg("fd"), py::arg("name"), py::arg("mode") = 0400, py::arg("gid") = -1,
        "Give a written segment its final mode (and group, if gid >= 0); returns a new read-only descriptor.");
    m.def("memfd_create", &create_memfd, py::arg("name"),
          "Create an anonymous segment that can be sealed (shown as `name` in /proc); returns its descriptor.");
    m.def("memfd_seal", &seal_memfd, py::arg("fd"), py::arg("name"),
          "Seal a written memfd against writes, growth and shrinking; returns a new read-only descriptor.");
    m.def("memfd_sealed", &memfd_sealed, py::arg("fd"),
          "Whether `fd` is a memfd sealed against writes, growth and shrinking (its bytes never change).");
    m.def("shm_footprint", &shm_footprint, py::arg("size"),
          "Bytes of shared memory a segment of `size` bytes takes (whole pages): what --shm-limit counts.");
    m.def("shm_unlink", &unlink_segment, py::arg("name"), "shm_unlink(name); False if it did not exist.");
    m.def(
        "_check_index_stream",
        [](py::bytes blob, size_t chunk, const std::string& label) {
            std::string_view bytes = blob;
            if (bytes.size() < kHeaderSize) throw py::value_error("shorter than a header");
            if (chunk == 0) throw py::value_error("chunk must be > 0");
            Header h;
            std::memcpy(&h, bytes.data(), sizeof h);
            validate_header(h, bytes.size(), label);
            IndexChecker check(h);
            const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
            for (size_t at = kHeaderSize; at < bytes.size(); at += chunk)
                check.update(p + at, std::min(chunk, bytes.size() - at));
            check.finish(label);
        },
        py::arg("blob"), py::arg("chunk"), py::arg("label"),
        "Check a blob's offsets index as a load does, its bytes fed `chunk` at a time (for tests).");
}

}  // namespace smstore::bindings
