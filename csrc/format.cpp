// Structural validation and the checksum rule of the blob format.
#include "format.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>

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

void reject_short_blob(const unsigned char* head, size_t size, uint64_t file_size, const std::string& label) {
    if (size >= sizeof kMagic && std::memcmp(head, kMagic, sizeof kMagic) == 0) {
        fail(Error::Kind::Truncated, label,
             "truncated: file is " + std::to_string(file_size) + " bytes, shorter than the " +
                 std::to_string(kHeaderSize) + "-byte header");
    }
    fail(Error::Kind::Format, label,
         std::string("not an smstore blob (") + (file_size == 0 ? "empty file" : "bad magic bytes") + ")");
}

Header parse_header(const unsigned char* bytes, size_t size, std::optional<uint64_t> file_size,
                    const std::string& label) {
    if (file_size && *file_size < kHeaderSize) reject_short_blob(bytes, size, *file_size, label);
    if (size < sizeof(Header)) {
        if (size < sizeof kMagic || std::memcmp(bytes, kMagic, sizeof kMagic) != 0) {
            fail(Error::Kind::Format, label,
                 std::string("not an smstore blob (") + (size == 0 ? "empty header" : "bad magic bytes") + ")");
        }
        fail(Error::Kind::Truncated, label, "truncated: the header could not be read in full");
    }
    Header h;
    std::memcpy(&h, bytes, sizeof h);
    if (!file_size) {
        // No blob is larger than a file can be; a header that says so is not one.
        if (std::memcmp(h.magic, kMagic, sizeof kMagic) == 0 &&
            h.file_size > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
            fail(Error::Kind::Format, label,
                 "not an smstore blob (a header claiming " + std::to_string(h.file_size) + " bytes)");
        }
        if (h.file_size < kHeaderSize && std::memcmp(h.magic, kMagic, sizeof kMagic) == 0) {
            reject_short_blob(bytes, size, h.file_size, label);
        }
    }
    validate_header(h, file_size ? *file_size : h.file_size, label);
    return h;
}

uint64_t blob_size(uint64_t record_count, uint64_t data_size, uint64_t meta_size) {
    uint64_t pad = (kIndexAlign - data_size % kIndexAlign) % kIndexAlign;
    return kHeaderSize + data_size + pad + (record_count + 1) * sizeof(uint64_t) + meta_size;
}

namespace {

// The index faults, worded once for validate_index() and IndexChecker.
[[noreturn]] void first_offset_fault(const std::string& label, uint64_t first) {
    fail(Error::Kind::Format, label, "corrupt index: first offset is " + std::to_string(first) + ", not 0");
}

[[noreturn]] void backwards_fault(const std::string& label, uint64_t i, uint64_t value, uint64_t prev) {
    fail(Error::Kind::Format, label,
         "corrupt index: offset of record " + std::to_string(i) + " goes backwards (" + std::to_string(value) + " < " +
             std::to_string(prev) + ")");
}

[[noreturn]] void last_offset_fault(const std::string& label, uint64_t last, uint64_t data_size) {
    fail(Error::Kind::Format, label,
         "corrupt index: last offset " + std::to_string(last) + " does not end the " + std::to_string(data_size) +
             "-byte data section");
}

}  // namespace

void validate_index(const uint64_t* offsets, uint64_t record_count, uint64_t data_size, const std::string& label) {
    if (offsets[0] != 0) first_offset_fault(label, offsets[0]);
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
            if (offsets[i] < offsets[i - 1]) backwards_fault(label, i, offsets[i], offsets[i - 1]);
        }
    }
    if (prev != data_size) last_offset_fault(label, prev, data_size);
}

void IndexChecker::entry(uint64_t value) noexcept {
    uint64_t i = seen_++;
    if (i == 0) {
        first_ = value;
    } else if (value < prev_ && bad_ == 0) {
        bad_ = i;
        bad_value_ = value;
        bad_prev_ = prev_;
    }
    prev_ = value;
}

void IndexChecker::update(const unsigned char* data, size_t size) noexcept {
    uint64_t end = begin_ + (count_ + 1) * sizeof(uint64_t);
    uint64_t from = std::max(pos_, begin_), to = std::min(pos_ + size, end);
    pos_ += size;
    if (from >= to) return;
    const unsigned char* p = data + (from - (pos_ - size));
    auto left = static_cast<size_t>(to - from);
    if (carried_) {  // finish the entry the last update split
        size_t take = std::min(sizeof(uint64_t) - carried_, left);
        std::memcpy(carry_ + carried_, p, take);
        carried_ += take;
        p += take;
        left -= take;
        if (carried_ < sizeof(uint64_t)) return;
        uint64_t value;
        std::memcpy(&value, carry_, sizeof value);
        entry(value);
        carried_ = 0;
    }
    for (; left >= sizeof(uint64_t); p += sizeof(uint64_t), left -= sizeof(uint64_t)) {
        uint64_t value;
        std::memcpy(&value, p, sizeof value);
        entry(value);
    }
    std::memcpy(carry_, p, left);
    carried_ = left;
}

void IndexChecker::finish(const std::string& label) const {
    if (seen_ != count_ + 1) {
        fail(Error::Kind::Truncated, label,
             "the index was cut short (" + std::to_string(seen_) + " of " + std::to_string(count_ + 1) + " offsets)");
    }
    // In validate_index()'s order: the first offset, the first step back, the end.
    if (first_ != 0) first_offset_fault(label, first_);
    if (bad_ != 0) backwards_fault(label, bad_, bad_value_, bad_prev_);
    if (prev_ != data_size_) last_offset_fault(label, prev_, data_size_);
}

std::string_view read_tail(const Header& h, const unsigned char* tail, uint64_t size, uint64_t* offsets,
                           const std::string& label) {
    uint64_t want = tail_end(h) - h.index_offset;
    if (size != want) {
        fail(size < want ? Error::Kind::Truncated : Error::Kind::Format, label,
             "its index and metadata are " + std::to_string(want) + " bytes, " + std::to_string(size) + " were read");
    }
    std::memcpy(offsets, tail, h.index_size);
    validate_index(offsets, h.record_count, h.data_size, label);
    uint64_t meta = h.meta_offset - h.index_offset;
    return {reinterpret_cast<const char*>(tail + meta), h.meta_size};
}

uint64_t BlobHasher::finish(const unsigned char* header) noexcept {
    unsigned char copy[kHeaderSize];
    std::memcpy(copy, header, kHeaderSize);
    std::memset(copy + kChecksumFieldOffset, 0, sizeof(uint64_t));
    xxh_.update(copy, kHeaderSize);
    return xxh_.digest();
}

void FileHasher::update(const unsigned char* data, size_t size) noexcept {
    if (pos_ < kHeaderSize) {
        size_t take = static_cast<size_t>(std::min<uint64_t>(size, kHeaderSize - pos_));
        std::memcpy(header_ + pos_, data, take);
        data += take;
        size -= take;
        pos_ += take;
    }
    hasher_.update(data, size);
    pos_ += size;
}

uint64_t FileHasher::finish(const std::string& label) {
    if (pos_ < kHeaderSize) {
        fail(Error::Kind::Truncated, label,
             "truncated: " + std::to_string(pos_) + " bytes, shorter than the " + std::to_string(kHeaderSize) +
                 "-byte header");
    }
    return hasher_.finish(header_);
}

uint64_t FileHasher::stored() const noexcept {
    uint64_t value;
    std::memcpy(&value, header_ + kChecksumFieldOffset, sizeof value);
    return value;
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
