// The on-disk blob layout (docs/format.md is the prose version of this file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "xxhash64.hpp"

namespace smstore {

// PNG-style magic: the high byte and CR/LF catch 7-bit and newline-translating copies.
inline constexpr unsigned char kMagic[8] = {0x89, 'S', 'M', 'S', 'T', '\r', '\n', 0x1a};
inline constexpr uint32_t kFormatVersion = 1;
inline constexpr uint64_t kHeaderSize = 4096;  // the data section starts page-aligned
inline constexpr uint32_t kChecksumXxh64 = 1;
inline constexpr uint64_t kIndexAlign = 8;

// Little-endian, fixed 4096 bytes on disk: this struct, then zeros up to kHeaderSize.
struct Header {
    unsigned char magic[8];
    uint32_t version;
    uint32_t header_size;
    uint64_t flags;  // no flags are defined in version 1; any set bit is refused
    uint64_t file_size;
    uint64_t record_count;
    uint64_t data_offset;
    uint64_t data_size;
    uint64_t index_offset;  // (record_count + 1) little-endian u64 offsets into the data section
    uint64_t index_size;
    uint64_t meta_offset;  // UTF-8 JSON object
    uint64_t meta_size;
    uint32_t checksum_algo;
    uint32_t reserved0;
    uint64_t checksum;  // XXH64 of bytes [header_size, file_size) then the header with this field zeroed
};
static_assert(sizeof(Header) == 104, "Header must have no padding");
inline constexpr size_t kChecksumFieldOffset = offsetof(Header, checksum);

// Validates a header against the real file size; throws Error naming `label` and the fault.
void validate_header(const Header& h, uint64_t actual_file_size, const std::string& label);

// Validates the offsets index: starts at 0, never decreases, ends at data_size. O(records).
void validate_index(const uint64_t* offsets, uint64_t record_count, uint64_t data_size, const std::string& label);

// The checksum rule, for every place that computes one (writer, loader, verify): XXH64 of the bytes
// after the header in file order, then of the header with its checksum field as zero. Hashing the
// header last lets the writer and the loader hash the data as it streams by.
// Checks the offsets index of a blob as the file's bytes stream past, in order from kHeaderSize:
// the faults validate_index() finds, in the same words, for a copy that reads every byte anyway
// (a load into shared memory) and so needs no second pass over the index.
class IndexChecker {
public:
    explicit IndexChecker(const Header& h) noexcept
        : begin_(h.index_offset), count_(h.record_count), data_size_(h.data_size) {}
    // The next `size` bytes of the file.
    void update(const unsigned char* data, size_t size) noexcept;
    // Throws Error(Format) naming `label` if the index is corrupt.
    void finish(const std::string& label) const;

private:
    void entry(uint64_t value) noexcept;

    uint64_t pos_ = kHeaderSize;  // file offset of the next byte
    uint64_t begin_, count_, data_size_;
    uint64_t seen_ = 0;  // entries read
    uint64_t prev_ = 0;
    unsigned char carry_[8] = {};  // an entry split between two updates
    size_t carried_ = 0;
    uint64_t first_ = 0;  // entry 0, which must be 0
    uint64_t bad_ = 0;    // the first entry that goes backwards (0: none)
    uint64_t bad_value_ = 0, bad_prev_ = 0;
};

class BlobHasher {
public:
    // The next bytes after the header, in file order.
    void update(const void* data, size_t size) noexcept { xxh_.update(data, size); }
    // Hashes the kHeaderSize bytes at `header` (its checksum field counts as zero) and returns the checksum.
    uint64_t finish(const unsigned char* header) noexcept;

private:
    Xxh64 xxh_;
};

// Checksum of a complete blob held in memory.
uint64_t blob_checksum(const unsigned char* file, uint64_t file_size);

// A checksum as every message and the Python API show it: 16 lowercase hex digits.
std::string checksum_hex(uint64_t checksum);

// Throws Error(Checksum) naming `label` and both values unless stored == actual; `note` ends the message.
void check_checksum(uint64_t stored, uint64_t actual, const std::string& label, const char* note = "");

}  // namespace smstore
