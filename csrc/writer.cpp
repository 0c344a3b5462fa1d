// Writer and pack_lines: the streaming hot loop of `smstore pack`.
#include "writer.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>

#include "error.hpp"
#include "format.hpp"
#include "json_check.hpp"
#include "line_scanner.hpp"

namespace smstore {
namespace {

// Small enough to stay in L2 between filling the buffer, hashing it and copying it to the kernel:
// a 4 MiB buffer made each of those passes a trip to L3 or DRAM.
constexpr size_t kBufferSize = 256 << 10;
// A durable pack starts writeback every this many bytes, so the disk works while we pack and the
// final fsync has little left to do.
constexpr uint64_t kWritebackEvery = 8 << 20;

std::string dir_of(const std::string& path) {
    auto slash = path.rfind('/');
    if (slash == std::string::npos) return ".";
    if (slash == 0) return "/";
    return path.substr(0, slash);
}

std::string random_suffix() {
    static const char chars[] = "abcdefghijklmnopqrstuvwxyz0123456789";
    std::random_device rd;
    std::string s(10, 'x');
    for (char& c : s)
        c = chars[rd() % (sizeof chars - 1)];
    return s;
}

std::string temp_name_for(const std::string& path) {
    auto slash = path.rfind('/');
    std::string base = slash == std::string::npos ? path : path.substr(slash + 1);
    std::string dir = slash == std::string::npos ? "" : path.substr(0, slash + 1);
    base = base.substr(0, 180);  // the suffix must fit too: names are at most 255 bytes
    return dir + "." + base + ".smstore-tmp-" + std::to_string(::getpid()) + "-" + random_suffix();
}

void fsync_dir(const std::string& dir) {
    int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return;  // best effort: the rename itself already happened
    ::fsync(dfd);
    ::close(dfd);
}

}  // namespace

Writer::Writer(std::string path, bool durable) : path_(std::move(path)), durable_(durable), buf_(kBufferSize) {
    if (path_.empty()) throw Error(Error::Kind::Io, "output path is empty");
    std::string dir = dir_of(path_);
    struct stat st;
    if (::stat(path_.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
        throw Error(Error::Kind::Io, path_ + ": is a directory; give a file name for the output");
    }
    // Unnamed until finish(): a killed pack leaves nothing behind at all.
    fd_ = ::open(dir.c_str(), O_TMPFILE | O_WRONLY | O_CLOEXEC, 0666);
    if (fd_ < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
        tmp_path_ = temp_name_for(path_);
        fd_ = ::open(tmp_path_.c_str(), O_CREAT | O_EXCL | O_WRONLY | O_CLOEXEC, 0666);
        if (fd_ < 0) throw_errno(tmp_path_, errno);
    } else if (fd_ < 0) {
        throw_errno(path_ + ": cannot create the output in " + dir, errno);
    }
    begin();
}

Writer::Writer(int fd, std::string label)
    : path_(std::move(label)), durable_(false), to_fd_(true), fd_(fd), buf_(kBufferSize) {
    if (fd_ < 0) throw Error(Error::Kind::Io, path_ + ": invalid file descriptor");
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
        int err = errno;
        abort();
        throw_errno(path_, err);
    }
    if (!S_ISREG(st.st_mode) || st.st_size != 0) {
        abort();
        throw Error(Error::Kind::Io, path_ + ": a writer needs an empty regular file");
    }
    begin();
}

void Writer::begin() {
    // The header is written last; until then the first 4096 bytes are a hole that reads as zeros.
    if (::lseek(fd_, static_cast<off_t>(kHeaderSize), SEEK_SET) < 0) {
        int err = errno;
        abort();
        throw_errno(path_, err);
    }
    offsets_.reserve(1024);
    offsets_.push_back(0);
}

Writer::~Writer() {
    abort();
}

void Writer::check_open() const {
    if (fd_ < 0) throw Error(Error::Kind::Io, path_ + ": writer is closed");
}

void Writer::write_all(const void* data, size_t size) {
    written_ += size;
    auto p = static_cast<const char*>(data);
    while (size) {
        ssize_t n = ::write(fd_, p, size);
        if (n < 0) {
            if (errno == EINTR) continue;
            int err = errno;
            abort();
            throw_errno(path_ + ": write failed", err);
        }
        p += n;
        size -= static_cast<size_t>(n);
    }
    if (durable_ && written_ - synced_ >= kWritebackEvery) {
        // Asynchronous: queues the pages for writeback; fsync in publish() still waits for all of it.
        ::sync_file_range(fd_, static_cast<off_t>(kHeaderSize + synced_), static_cast<off_t>(written_ - synced_),
                          SYNC_FILE_RANGE_WRITE);
        synced_ = written_;
    }
}

void Writer::flush_buffer() {
    if (!buf_used_) return;
    hash_.update(buf_.data(), buf_used_);
    write_all(buf_.data(), buf_used_);
    buf_used_ = 0;
}

void Writer::put_slow(const void* data, size_t size) {
    flush_buffer();
    if (size >= buf_.size() / 2) {  // large pieces bypass the buffer
        hash_.update(data, size);
        write_all(data, size);
        return;
    }
    std::memcpy(buf_.data(), data, size);
    buf_used_ = size;
}

void Writer::finish(std::string_view metadata_json) {
    if (to_fd_) throw Error(Error::Kind::Io, path_ + ": this writer writes into a descriptor; use finish_fd()");
    write_tail(metadata_json);
    publish();
}

int Writer::finish_fd(std::string_view metadata_json) {
    if (!to_fd_) throw Error(Error::Kind::Io, path_ + ": this writer publishes a file; use finish()");
    write_tail(metadata_json);
    int fd = fd_;
    fd_ = -1;
    std::vector<uint64_t>().swap(offsets_);
    return fd;
}

void Writer::write_tail(std::string_view metadata_json) {
    check_open();
    if (offsets_.back() != data_size_) {  // write_data() without its end_record()
        throw Error(Error::Kind::Input, path_ + ": the last record was left unfinished; nothing was written");
    }
    Header h{};
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.version = kFormatVersion;
    h.header_size = kHeaderSize;
    h.record_count = record_count();
    h.data_offset = kHeaderSize;
    h.data_size = data_size_;

    static const unsigned char zeros[kIndexAlign] = {};
    size_t pad = (kIndexAlign - file_pos_ % kIndexAlign) % kIndexAlign;
    put(zeros, pad);
    h.index_offset = kHeaderSize + file_pos_;
    h.index_size = offsets_.size() * sizeof(uint64_t);
    put(offsets_.data(), h.index_size);
    h.meta_offset = kHeaderSize + file_pos_;
    h.meta_size = metadata_json.size();
    put(metadata_json.data(), metadata_json.size());
    flush_buffer();
    h.file_size = kHeaderSize + file_pos_;
    h.checksum_algo = kChecksumXxh64;

    unsigned char header[kHeaderSize] = {};
    std::memcpy(header, &h, sizeof h);
    hash_.update(header, kHeaderSize);  // checksum field is still zero here
    h.checksum = hash_.digest();
    std::memcpy(header, &h, sizeof h);
    if (::pwrite(fd_, header, kHeaderSize, 0) != static_cast<ssize_t>(kHeaderSize)) {
        int err = errno;
        abort();
        throw_errno(path_ + ": writing the header failed", err ? err : EIO);
    }
}

void Writer::publish() {
    if (durable_ && ::fsync(fd_) != 0) {
        int err = errno;
        abort();
        throw_errno(path_ + ": fsync failed", err);
    }
    if (tmp_path_.empty()) {
        // Give the unnamed file a temporary name, then rename it over the target (linkat cannot replace).
        tmp_path_ = temp_name_for(path_);
        std::string proc = "/proc/self/fd/" + std::to_string(fd_);
        if (::linkat(AT_FDCWD, proc.c_str(), AT_FDCWD, tmp_path_.c_str(), AT_SYMLINK_FOLLOW) != 0) {
            int err = errno;
            tmp_path_.clear();
            abort();
            throw_errno(path_ + ": cannot link the finished file", err);
        }
    }
    if (::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
        int err = errno;
        abort();
        throw_errno(path_ + ": rename failed", err);
    }
    tmp_path_.clear();
    ::close(fd_);
    fd_ = -1;
    if (durable_) fsync_dir(dir_of(path_));
    std::vector<uint64_t>().swap(offsets_);
}

void Writer::abort() noexcept {
    if (fd_ >= 0) {
        ::close(fd_);
        fd_ = -1;
    }
    if (!tmp_path_.empty()) {
        ::unlink(tmp_path_.c_str());
        tmp_path_.clear();
    }
}

namespace {

void check_json_line(const std::string& file, uint64_t line_no, const char* p, size_t n) {
    std::string why;
    size_t column = 0;
    if (!json_valid(p, n, &why, &column)) {
        throw Error(Error::Kind::Input, file + ":" + std::to_string(line_no) + ": invalid JSON: " + why + " (column " +
                                            std::to_string(column) + ")");
    }
}

}  // namespace

uint64_t pack_lines(Writer& writer, const std::vector<std::string>& inputs, LineFormat format, PackProgress* progress) {
    if (format == LineFormat::Lines) {
        return scan_lines(inputs, progress,
                          [&](const std::string&, uint64_t, const char* p, size_t n, bool, bool ends) {
                              writer.write_data(p, n);
                              if (ends) writer.end_record();
                          });
    }
    LineJoiner joiner;
    return scan_lines(inputs, progress,
                      [&](const std::string& file, uint64_t line_no, const char* p, size_t n, bool starts, bool ends) {
                          writer.write_data(p, n);
                          if (joiner.add(p, n, starts, ends)) {
                              check_json_line(file, line_no, p, n);
                              writer.end_record();
                          }
                      });
}

}  // namespace smstore
