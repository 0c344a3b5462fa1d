// Writer: buffered, hashed, atomically published output of every packer.
#include "writer.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <random>

#include "error.hpp"

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

// The permission bits of the file at `path` that publishing would replace, or -1 if there is none.
// rename() would swap a FIFO, device or socket for a regular file: refuse anything but a regular file.
// lstat, not stat: the rename in finish() replaces a symbolic link itself, not its target, so a link
// is refused as smstore.write.pack.check_output refuses it (the one rule for outputs, docs/format.md).
int replaced_mode(const std::string& path) {
    struct stat st;
    if (::lstat(path.c_str(), &st) != 0) return -1;
    if (S_ISDIR(st.st_mode)) throw Error(Error::Kind::Io, path + ": is a directory; give a file name for the output");
    if (S_ISLNK(st.st_mode)) {
        throw Error(Error::Kind::Io,
                    path +
                        ": is a symbolic link; smstore renames a new file over its output, which "
                        "would replace the link itself: give the link's target or another output path");
    }
    if (!S_ISREG(st.st_mode)) {
        throw Error(Error::Kind::Io, path +
                                         ": is not a regular file (a FIFO, device or socket); smstore only "
                                         "replaces regular files: give another output path");
    }
    return static_cast<int>(st.st_mode & 0777);
}

void fsync_dir(const std::string& dir) {
    int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return;  // best effort: the rename itself already happened
    ::fsync(dfd);
    ::close(dfd);
}

}  // namespace

Writer::Writer(std::string path, bool durable, uint64_t item_size)
    : path_(std::move(path)), durable_(durable), item_size_(item_size), buf_(kBufferSize) {
    if (path_.empty()) throw Error(Error::Kind::Io, "output path is empty");
    if (item_size_ == 0) throw Error(Error::Kind::Input, path_ + ": the item size of records must be at least 1");
    std::string dir = dir_of(path_);
    replaced_mode(path_);  // refuse a directory or special file before any work
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

void Writer::spill_offsets() {
    if (spill_fd_ < 0) {
        if (to_fd_) {
            spill_fd_ = ::memfd_create("smstore-index", MFD_CLOEXEC);
        } else {
            spill_fd_ = ::open(dir_of(path_).c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
            if (spill_fd_ < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL)) {
                std::string name = temp_name_for(path_) + "-index";
                spill_fd_ = ::open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
                if (spill_fd_ >= 0) ::unlink(name.c_str());
            }
        }
        if (spill_fd_ < 0) {
            int err = errno;
            abort();
            throw_errno(path_ + ": cannot create a temporary file for the offsets index", err);
        }
    }
    size_t bytes = offsets_.size() * sizeof(uint64_t);
    auto p = reinterpret_cast<const char*>(offsets_.data());
    for (size_t done = 0; done < bytes;) {
        ssize_t n = ::pwrite(spill_fd_, p + done, bytes - done, static_cast<off_t>(spilled_ * sizeof(uint64_t) + done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            int err = n < 0 ? errno : EIO;
            abort();
            throw_errno(path_ + ": writing the offsets index to a temporary file failed", err);
        }
        done += static_cast<size_t>(n);
    }
    spilled_ += offsets_.size();
    offsets_.clear();
}

void Writer::copy_spilled_offsets() {
    if (spill_fd_ < 0) return;
    std::vector<uint64_t> chunk(kIndexChunk);
    auto p = reinterpret_cast<char*>(chunk.data());
    for (uint64_t pos = 0, total = spilled_ * sizeof(uint64_t); pos < total;) {
        size_t want = static_cast<size_t>(std::min<uint64_t>(total - pos, kIndexChunk * sizeof(uint64_t)));
        ssize_t n = ::pread(spill_fd_, p, want, static_cast<off_t>(pos));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
            int err = n < 0 ? errno : EIO;
            abort();
            throw_errno(path_ + ": reading back the offsets index failed", err);
        }
        put(p, static_cast<size_t>(n));
        pos += static_cast<uint64_t>(n);
    }
}

Writer::~Writer() {
    abort();
}

void Writer::check_open() const {
    if (fd_ < 0) throw Error(Error::Kind::Closed, path_ + ": writer is closed");
}

void Writer::reject_record_size(uint64_t size) const {
    throw Error(Error::Kind::Input, path_ + ": record " + std::to_string(records_) + " is " + std::to_string(size) +
                                        " bytes, not a whole number of " + std::to_string(item_size_) +
                                        "-byte items of its dtype");
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
    abort();  // only the spill file is left to close
    std::vector<uint64_t>().swap(offsets_);
    return fd;
}

void Writer::write_tail(std::string_view metadata_json) {
    check_open();
    if (record_start_ != data_size_) {  // write_data() without its end_record()
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
    h.index_size = (spilled_ + offsets_.size()) * sizeof(uint64_t);
    copy_spilled_offsets();
    put(offsets_.data(), offsets_.size() * sizeof(uint64_t));
    h.meta_offset = kHeaderSize + file_pos_;
    h.meta_size = metadata_json.size();
    put(metadata_json.data(), metadata_json.size());
    flush_buffer();
    h.file_size = kHeaderSize + file_pos_;
    h.checksum_algo = kChecksumXxh64;

    unsigned char header[kHeaderSize] = {};
    std::memcpy(header, &h, sizeof h);
    h.checksum = hash_.finish(header);
    std::memcpy(header, &h, sizeof h);
    if (::pwrite(fd_, header, kHeaderSize, 0) != static_cast<ssize_t>(kHeaderSize)) {
        int err = errno;
        abort();
        throw_errno(path_ + ": writing the header failed", err ? err : EIO);
    }
}

void Writer::publish() {
    int mode;
    try {
        mode = replaced_mode(path_);  // again: the path may have changed since the constructor looked
    } catch (...) {
        abort();
        throw;
    }
    // A new file keeps the umask's mode from its creation; a replaced one keeps its own.
    if (mode >= 0 && ::fchmod(fd_, static_cast<mode_t>(mode)) != 0) {
        int err = errno;
        abort();
        throw_errno(path_ + ": fchmod failed", err);
    }
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
    abort();  // only the spill file is left to close
    if (durable_) fsync_dir(dir_of(path_));
    std::vector<uint64_t>().swap(offsets_);
}

void Writer::abort() noexcept {
    if (spill_fd_ >= 0) {
        ::close(spill_fd_);
        spill_fd_ = -1;
    }
    if (fd_ >= 0) {
        ::close(fd_);
        fd_ = -1;
    }
    if (!tmp_path_.empty()) {
        ::unlink(tmp_path_.c_str());
        tmp_path_.clear();
    }
}

}  // namespace smstore
