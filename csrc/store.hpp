// Read side of the core: a read-only mapping of a blob and validated, bounds-checked access to its records.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "error.hpp"
#include "format.hpp"

namespace smstore {

// A read-only mapping that is unmapped when the last owner lets go of it.
class Mapping {
public:
    // Maps a regular file; refuses FIFOs, devices and directories instead of blocking on them.
    static std::shared_ptr<const Mapping> map_file(const std::string& path);
    // Maps all of an open descriptor (a blob file or a shared-memory segment); the caller keeps the fd.
    static std::shared_ptr<const Mapping> map_fd(int fd, const std::string& label);

    Mapping(const unsigned char* data, uint64_t size) : data_(data), size_(size) {}
    ~Mapping();
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;

    const unsigned char* data() const noexcept { return data_; }
    uint64_t size() const noexcept { return size_; }

private:
    const unsigned char* data_;
    uint64_t size_;
};

// The checksum in the header of the blob at `path`, from one small read without mapping or
// validating anything (so a daemon client can ask for the file by content, cheaply); nullopt when
// it is not a regular file that starts with the magic bytes. Throws Error if it cannot be opened.
std::optional<uint64_t> peek_checksum(const std::string& path);

// The header of the blob open at `fd`, validated against the file's size with the faults and words
// of every open (a foreign or short file, validate_header()); neither the index nor the records are
// read. The one header parser: Python reads headers only through this (docs/format.md, "Header").
// Throws Error naming `label`.
Header read_header_fd(int fd, const std::string& label);
// read_header_fd() of the file at `path`, opened O_NONBLOCK (a FIFO is refused, never waited on).
Header read_header(const std::string& path);

class Store {
public:
    // Validates the header and the whole offsets index (O(records), data untouched). With
    // full_index false only the index's ends are checked, in O(1): for segments that the daemon
    // validated when it loaded them (see shm.hpp). Readers of such a Store must check each record's
    // offsets against data_size() (the bindings do; gather_size() does).
    Store(std::shared_ptr<const Mapping> mapping, std::string label, bool full_index = true);
    static std::shared_ptr<Store> open(const std::string& path);

    uint64_t size() const noexcept { return header_.record_count; }
    const Header& header() const noexcept { return header_; }
    const std::string& label() const noexcept { return label_; }
    const std::shared_ptr<const Mapping>& mapping() const noexcept { return mapping_; }

    const unsigned char* data() const noexcept { return data_; }
    uint64_t data_size() const noexcept { return header_.data_size; }
    const uint64_t* offsets() const noexcept { return offsets_; }
    std::string_view metadata() const noexcept;

    // Whether a record's offsets [begin, end) lie inside a data section of data_size bytes: the
    // check every read makes, since an index validated only at its ends may hold anything between.
    static bool span_inside(uint64_t begin, uint64_t end, uint64_t data_size) noexcept {
        return begin <= end && end <= data_size;
    }
    // The error for record i, whose offsets failed span_inside().
    Error span_error(uint64_t i, uint64_t begin, uint64_t end) const;

    uint64_t stored_checksum() const noexcept { return header_.checksum; }
    uint64_t compute_checksum() const noexcept;
    void verify() const;  // throws Error(Checksum) on mismatch

    // Total bytes of the records at `indices` (each < size()). Checks each record lies inside the
    // data section (throws Error(Format) if not), so gather() may trust them.
    uint64_t gather_size(const uint64_t* indices, size_t n) const;
    // Copies them back to back into out; out_offsets gets n + 1 entries.
    void gather(const uint64_t* indices, size_t n, unsigned char* out, int64_t* out_offsets) const noexcept;

private:
    std::shared_ptr<const Mapping> mapping_;
    std::string label_;
    Header header_;
    const unsigned char* data_;
    const uint64_t* offsets_;
};

}  // namespace smstore
