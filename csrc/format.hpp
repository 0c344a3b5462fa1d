// The on-disk blob layout (docs/format.md is the prose version of this file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

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

// The header at the start of `bytes` (`size` of them: a blob's first kHeaderSize bytes, or fewer),
// validated against a blob of `file_size` bytes (unknown: the size the header itself records, which
// must fit an off_t). The one header parser: read_header_fd() and every header read as bytes (a
// ranged GET of an object) go through it. Throws Error naming `label`: a foreign or short header
// (reject_short_blob()'s words), then validate_header()'s faults.
Header parse_header(const unsigned char* bytes, size_t size, std::optional<uint64_t> file_size,
                    const std::string& label);

// Throws the fault of a blob file of `file_size` bytes (less than kHeaderSize) whose first `size`
// bytes are `head`: a truncated blob if they start with the magic, else a foreign file.
[[noreturn]] void reject_short_blob(const unsigned char* head, size_t size, uint64_t file_size,
                                    const std::string& label);

// Bytes of the blob the writer lays out for `record_count` records of `data_size` bytes in all and
// `meta_size` bytes of metadata: the header, the data, the aligned index, the metadata.
uint64_t blob_size(uint64_t record_count, uint64_t data_size, uint64_t meta_size);

// A blob's tail: its index and metadata, the bytes [h.index_offset, tail_end(h)) (validate_header()
// keeps the metadata after the index).
inline uint64_t tail_end(const Header& h) noexcept {
    return h.meta_offset + h.meta_size;
}

// Copies the index of the blob `h` heads out of its tail (`size` bytes at `tail`) into `offsets`
// (h.record_count + 1 entries), validated as validate_index() does, and returns its metadata (a view
// into `tail`). Throws Error naming `label`: a tail of another length, a corrupt index.
std::string_view read_tail(const Header& h, const unsigned char* tail, uint64_t size, uint64_t* offsets,
                           const std::string& label);

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

// BlobHasher fed a blob's bytes in file order from its first byte (a download streaming the whole
// object): it keeps the header aside and hashes it last, as the rule says.
class FileHasher {
public:
    void update(const unsigned char* data, size_t size) noexcept;
    uint64_t fed() const noexcept { return pos_; }
    // The checksum; throws Error(Truncated) naming `label` if less than a header was fed.
    uint64_t finish(const std::string& label);
    // The checksum field of the header fed (0 until it was).
    uint64_t stored() const noexcept;

private:
    BlobHasher hasher_;
    unsigned char header_[kHeaderSize] = {};
    uint64_t pos_ = 0;
};

// Checksum of a complete blob held in memory.
uint64_t blob_checksum(const unsigned char* file, uint64_t file_size);

// A checksum as every message and the Python API show it: 16 lowercase hex digits.
std::string checksum_hex(uint64_t checksum);

// Throws Error(Checksum) naming `label` and both values unless stored == actual; `note` ends the message.
void check_checksum(uint64_t stored, uint64_t actual, const std::string& label, const char* note = "");

}  // namespace smstore
