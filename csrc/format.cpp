// Structural validation and the checksum rule of the blob format.
#include "format.hpp"

#include <cstdio>
#include <cstring>

#include "error.hpp"

namespace smstore {
namespace {

[[noreturn]] void fail(Error::Kind kind, const std::string& label, const std::string& what) {
    throw Error(kind, label + ": " + what);
}

// a + b without wrapping; false on overflow.
bool add_ok(uint64_t a, uint64_t b, uint64_t& out) {
    return !__builtin_add_overflow(a, b, &out);
}

void check_section(const std::string& label, const char* name, uint64_t offset, uint64_t size, uint64_t file_size) {
    uint64_t end;
    if (!add_ok(offset, size, end) || end > file_size) {
        fail(Error::Kind::Format, label,
             std::string("corrupt header: ") + name + " section [" + std::to_string(offset) + ", +" +
                 std::to_string(size) + ") lies outside the " + std::to_string(file_size) + "-byte file");
    }
}

}  // namespace

void validate_header(const Header& h, uint64_t actual_file_size, const std::string& label) {
    if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) {
        fail(Error::Kind::Format, label, "not an smstore blob (bad magic bytes)");
    }
    if (h.version != kFormatVersion) {
        fail(Error::Kind::Version, label,
             "format version " + std::to_string(h.version) + " is not supported (this smstore reads version " +
                 std::to_string(kFormatVersion) + "); upgrade smstore or re-pack the data");
    }
    if (h.header_size != kHeaderSize) {
        fail(Error::Kind::Format, label, "corrupt header: header size " + std::to_string(h.header_size));
    }
    if (h.flags != 0) {
        fail(Error::Kind::Version, label, "uses feature flags this smstore does not know; upgrade smstore");
    }
    if (h.checksum_algo != kChecksumXxh64) {
        fail(Error::Kind::Version, label, "unknown checksum algorithm " + std::to_string(h.checksum_algo));
    }
    if (h.file_size != actual_file_size) {
        Error::Kind kind = actual_file_size < h.file_size ? Error::Kind::Truncated : Error::Kind::Format;
        fail(kind, label,
             (actual_file_size < h.file_size ? "truncated: file is " : "wrong size: file is ") +
                 std::to_string(actual_file_size) + " bytes, header says " + std::to_string(h.file_size));
    }
    if (h.data_offset != kHeaderSize) {
        fail(Error::Kind::Format, label, "corrupt header: data offset " + std::to_string(h.data_offset));
    }
    check_section(label, "data", h.data_offset, h.data_size, actual_file_size);
    check_section(label, "index", h.index_offset, h.index_size, actual_file_size);
    check_section(label, "metadata", h.meta_offset, h.meta_size, actual_file_size);
    if (h.record_count > (UINT64_MAX / 8) - 1 || h.index_size != (h.record_count + 1) * 8) {
        fail(Error::Kind::Format, label,
             "corrupt header: index of " + std::to_string(h.index_size) + " bytes does not hold " +
                 std::to_string(h.record_count) + " + 1 offsets");
    }
    if (h.index_offset % kIndexAlign != 0 || h.index_offset < h.data_offset + h.data_size ||
        h.meta_offset < h.index_offset + h.index_size) {
        fail(Error::Kind::Format, label, "corrupt header: sections overlap or are misaligned");
    }
}

void validate_index(const uint64_t* offsets, uint64_t record_count, uint64_t data_size, const std::string& label) {
    if (offsets[0] != 0) {
        fail(Error::Kind::Format, label, "corrupt index: first offset is " + std::to_string(offsets[0]) + ", not 0");
    }
    // Branch-free scan (it runs on every open): remember whether any step went backwards.
    uint64_t prev = 0;
    bool decreasing = false;
    for (uint64_t i = 1; i <= record_count; ++i) {
        uint64_t cur = offsets[i];
        decreasing |= cur < prev;
        prev = cur;
    }
    if (decreasing) {
        for (uint64_t i = 1; i <= record_count; ++i) {
            if (offsets[i] < offsets[i - 1]) {
                fail(Error::Kind::Format, label,
                     "corrupt index: offset of record " + std::to_string(i) + " goes backwards (" +
                         std::to_string(offsets[i]) + " < " + std::to_string(offsets[i - 1]) + ")");
            }
        }
    }
    if (prev != data_size) {
        fail(Error::Kind::Format, label,
             "corrupt index: last offset " + std::to_string(prev) + " does not end the " + std::to_string(data_size) +
                 "-byte data section");
    }
}

uint64_t BlobHasher::finish(const unsigned char* header) noexcept {
    unsigned char copy[kHeaderSize];
    std::memcpy(copy, header, kHeaderSize);
    std::memset(copy + kChecksumFieldOffset, 0, sizeof(uint64_t));
    xxh_.update(copy, kHeaderSize);
    return xxh_.digest();
}

uint64_t blob_checksum(const unsigned char* file, uint64_t file_size) {
    BlobHasher hasher;
    hasher.update(file + kHeaderSize, file_size - kHeaderSize);
    return hasher.finish(file);
}

std::string checksum_hex(uint64_t checksum) {
    char buf[17];
    std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(checksum));
    return buf;
}

void check_checksum(uint64_t stored, uint64_t actual, const std::string& label, const char* note) {
    if (stored == actual) return;
    throw Error(Error::Kind::Checksum, label + ": checksum mismatch: stored " + checksum_hex(stored) +
                                           ", contents hash to " + checksum_hex(actual) +
                                           "; the file is corrupt, re-pack or re-copy it" + note);
}

}  // namespace smstore
