// Mapping and Store: everything a reader needs, with every structural fault reported before first use.
#include "store.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "error.hpp"
#include "unmapper.hpp"

namespace smstore {
namespace {

struct Fd {
    int fd;
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
};

// The size of the regular file at `fd`, at least a header long; the faults of every open otherwise.
uint64_t blob_file_size(int fd, const std::string& label) {
    struct stat st;
    if (::fstat(fd, &st) != 0) throw_errno(label, errno);
    if (!S_ISREG(st.st_mode)) {
        throw Error(Error::Kind::Format, label + ": not a regular file");
    }
    auto size = static_cast<uint64_t>(st.st_size);
    if (size < kHeaderSize) {  // too short to map: say whether it is foreign or a truncated blob
        unsigned char head[sizeof kMagic] = {};
        ssize_t got = ::pread(fd, head, sizeof head, 0);
        reject_short_blob(head, got > 0 ? static_cast<size_t>(got) : 0, size, label);
    }
    return size;
}

}  // namespace

Mapping::~Mapping() {
    if (size_) unmap_later(const_cast<unsigned char*>(data_), size_);
}

std::shared_ptr<const Mapping> Mapping::map_fd(int fd, const std::string& label) {
    uint64_t size = blob_file_size(fd, label);
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) throw_errno(label + ": mmap", errno);
    return std::make_shared<const Mapping>(static_cast<const unsigned char*>(p), size);
}

std::shared_ptr<const Mapping> Mapping::map_file(const std::string& path) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer; map_fd then refuses it.
    Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)};
    if (f.fd < 0) throw_errno(path, errno);
    return map_fd(f.fd, path);
}

std::optional<uint64_t> peek_checksum(const std::string& path) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer; it is then refused as not regular.
    Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)};
    if (f.fd < 0) throw_errno(path, errno);
    struct stat st;
    if (::fstat(f.fd, &st) != 0) throw_errno(path, errno);
    Header h;
    if (!S_ISREG(st.st_mode) || ::pread(f.fd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h) ||
        std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) {
        return std::nullopt;
    }
    return h.checksum;
}

Header read_header_fd(int fd, const std::string& label) {
    uint64_t size = blob_file_size(fd, label);
    unsigned char head[sizeof(Header)];
    ssize_t got = ::pread(fd, head, sizeof head, 0);
    if (got < 0) throw_errno(label, errno);
    // A file shrunk since fstat gives a short read: parse_header() calls that truncated.
    return parse_header(head, static_cast<size_t>(got), size, label);
}

Header read_header(const std::string& path) {
    // O_NONBLOCK: opening a FIFO must not wait for a writer; it is then refused as not regular.
    Fd f{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)};
    if (f.fd < 0) throw_errno(path, errno);
    return read_header_fd(f.fd, path);
}

Store::Store(std::shared_ptr<const Mapping> mapping, std::string label, bool full_index)
    : mapping_(std::move(mapping)), label_(std::move(label)) {
    std::memcpy(&header_, mapping_->data(), sizeof header_);
    validate_header(header_, mapping_->size(), label_);
    data_ = mapping_->data() + header_.data_offset;
    offsets_ = reinterpret_cast<const uint64_t*>(mapping_->data() + header_.index_offset);
    if (full_index) {
        validate_index(offsets_, header_.record_count, header_.data_size, label_);
    } else if (offsets_[0] != 0 || offsets_[header_.record_count] != header_.data_size) {
        throw Error(Error::Kind::Format, label_ + ": corrupt index: it does not span the data section");
    }
}

std::shared_ptr<Store> Store::open(const std::string& path) {
    return std::make_shared<Store>(Mapping::map_file(path), path);
}

std::string_view Store::metadata() const noexcept {
    return {reinterpret_cast<const char*>(mapping_->data() + header_.meta_offset), header_.meta_size};
}

uint64_t Store::compute_checksum() const noexcept {
    return blob_checksum(mapping_->data(), mapping_->size());
}

void Store::verify() const {
    check_checksum(header_.checksum, compute_checksum(), label_);
}

Error Store::span_error(uint64_t i, uint64_t begin, uint64_t end) const {
    return Error(Error::Kind::Format, label_ + ": corrupt index: record " + std::to_string(i) + " spans [" +
                                          std::to_string(begin) + ", " + std::to_string(end) + ") outside the " +
                                          std::to_string(header_.data_size) + "-byte data section");
}

uint64_t Store::gather_size(const uint64_t* indices, size_t n) const {
    uint64_t total = 0;
    for (size_t k = 0; k < n; ++k) {
        uint64_t i = indices[k], b = offsets_[i], e = offsets_[i + 1];
        if (!span_inside(b, e, header_.data_size)) throw span_error(i, b, e);
        if (__builtin_add_overflow(total, e - b, &total)) {  // the same huge record, many times over
            throw Error(Error::Kind::Format, label_ + ": the records asked for total more than 2^64 bytes");
        }
    }
    return total;
}

void Store::gather(const uint64_t* indices, size_t n, unsigned char* out, int64_t* out_offsets) const noexcept {
    uint64_t pos = 0;
    out_offsets[0] = 0;
    for (size_t k = 0; k < n; ++k) {
        uint64_t b = offsets_[indices[k]], e = offsets_[indices[k] + 1];
        std::memcpy(out + pos, data_ + b, e - b);
        pos += e - b;
        out_offsets[k + 1] = static_cast<int64_t>(pos);
    }
}

}  // namespace smstore
