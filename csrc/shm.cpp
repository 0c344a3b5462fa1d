// Loading blobs into POSIX shared memory: the room is checked and the pages reserved up front, so a
// full /dev/shm is an error at load time and never a SIGBUS in a reader later.
#include "shm.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

#include "error.hpp"
#include "format.hpp"
#include "unmapper.hpp"

namespace smstore {
namespace {

// Small enough that a chunk is still in cache when it is hashed and written after read().
constexpr size_t kChunk = size_t{256} << 10;
// Chunks in flight between the reading thread and the hashing and writing one.
constexpr size_t kSlots = 4;
// What one sendfile moves. The kernel copies it in one go, and a kernel built without preemption
// (PREEMPT_NONE, common on servers and VMs) cannot give the core to a training process meanwhile:
// 1 MiB took up to 4 ms on a 2-core VM, and a rank woken on that core waited that long.
constexpr size_t kSendChunk = size_t{128} << 10;
// What is copied before the hashing thread is told: small enough to be in cache still.
constexpr size_t kHashChunk = size_t{1} << 20;

std::string human(uint64_t n) {
    const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = static_cast<double>(n);
    int u = 0;
    while (v >= 1024 && u < 4) {
        v /= 1024;
        ++u;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
    return buf;
}

// What a load computes as the bytes pass, on the thread that hashes them: the checksum, and the
// check of the offsets index (so no second pass over the index is needed).
struct LoadDigest {
    BlobHasher hash;
    IndexChecker index;
    void update(const unsigned char* data, size_t size) noexcept {
        hash.update(data, size);
        index.update(data, size);
    }
};

struct Fd {
    int fd = -1;
    ~Fd() {
        if (fd >= 0) ::close(fd);
    }
};

// Unlinks the segment unless the load completed.
struct SegmentGuard {
    std::string name;
    bool keep = false;
    ~SegmentGuard() {
        if (!keep) ::shm_unlink(name.c_str());
    }
};

// Reads exactly n bytes unless the file ends first; returns how many were read.
size_t read_full(int fd, unsigned char* out, size_t n, const std::string& label) {
    size_t got = 0;
    while (got < n) {
        ssize_t r = ::read(fd, out + got, n - got);
        if (r < 0) {
            if (errno == EINTR) continue;
            throw_errno(label + ": read", errno);
        }
        if (r == 0) break;
        got += static_cast<size_t>(r);
    }
    return got;
}

// A failed write to the segment: a full filesystem becomes the same clear error as the room check.
[[noreturn]] void throw_write_error(int fd, int err, const std::string& name, const std::string& label,
                                    uint64_t needed) {
    if (err == ENOSPC) {
        // Room taken by someone else since the check: report what there was for this segment.
        auto written = static_cast<uint64_t>(std::max<off_t>(0, ::lseek(fd, 0, SEEK_CUR)));
        uint64_t had = written + shm_space(kShmDir).available;
        check_shm_room(needed, had < needed ? had : needed - 1, label);
    }
    throw_errno("write " + name, err);
}

// Writes all of buf.
void write_full(int fd, const unsigned char* buf, size_t n, const std::string& name, const std::string& label,
                uint64_t needed) {
    size_t done = 0;
    while (done < n) {
        ssize_t w = ::write(fd, buf + done, n - done);
        if (w < 0) {
            if (errno == EINTR) continue;
            throw_write_error(fd, errno, name, label, needed);
        }
        done += static_cast<size_t>(w);
    }
}

[[noreturn]] void throw_shrank(const std::string& path, uint64_t at, uint64_t n) {
    throw Error(Error::Kind::Truncated, path + ": file shrank while it was being loaded (" +
                                            std::to_string(kHeaderSize + at) + " of " +
                                            std::to_string(kHeaderSize + n) + " bytes); was it rewritten in place?");
}

// Sleeps until `pos` bytes are due at `max_rate` bytes/s since `started` (no limit when 0).
void pace(std::chrono::steady_clock::time_point started, uint64_t pos, uint64_t max_rate) {
    if (max_rate) {
        std::this_thread::sleep_until(
            started + std::chrono::duration<double>(static_cast<double>(pos) / static_cast<double>(max_rate)));
    }
}

// Copies `n` bytes from `src` to `dst` (both at their offsets) with sendfile: the kernel moves
// them from the page cache into the segment with one copy, while a helper thread digests each
// copied chunk through a read-only mapping of the segment (so what is checked is what readers will
// see). Returns false, having copied nothing, when the kernel cannot sendfile between these files;
// the caller then copies with read() and write().
bool sendfile_and_hash(int src, int dst, uint64_t n, LoadDigest& digest, const std::string& name,
                       const std::string& path, uint64_t needed, uint64_t max_rate) {
    auto started = std::chrono::steady_clock::now();
    size_t total = static_cast<size_t>(kHeaderSize + n);
    void* map = ::mmap(nullptr, total, PROT_READ, MAP_SHARED, dst, 0);
    if (map == MAP_FAILED) return false;
    const auto* data = static_cast<const unsigned char*>(map) + kHeaderSize;
    std::mutex mu;
    std::condition_variable cv;
    uint64_t copied = 0;  // bytes in the segment so far (written by this thread)
    bool done = false;    // no more bytes will be copied
    std::thread hasher([&] {
        uint64_t hashed = 0;
        for (;;) {
            uint64_t upto;
            {
                std::unique_lock<std::mutex> lock(mu);
                cv.wait(lock, [&] { return done || copied > hashed; });
                upto = copied;
                if (upto == hashed) return;  // done, and everything copied is hashed
            }
            digest.update(data + hashed, static_cast<size_t>(upto - hashed));
            hashed = upto;
        }
    });
    auto finish = [&] {
        {
            std::lock_guard<std::mutex> lock(mu);
            done = true;
        }
        cv.notify_all();
        hasher.join();
        unmap_later(map, total);  // tearing down its page table costs ~35 ms a GiB: not the load's
    };
    try {
        uint64_t pos = 0;
        uint64_t told = 0;  // bytes the hashing thread has been told of
        while (pos < n) {
            size_t want = static_cast<size_t>(std::min<uint64_t>(kSendChunk, n - pos));
            ssize_t got = ::sendfile(dst, src, nullptr, want);
            if (got < 0) {
                if (errno == EINTR) continue;
                if (pos == 0 && (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP)) {
                    finish();
                    return false;
                }
                if (errno == ENOSPC) throw_write_error(dst, errno, name, path, needed);
                throw_errno(path + ": sendfile to " + name, errno);
            }
            if (got == 0) throw_shrank(path, pos, n);
            pos += static_cast<uint64_t>(got);
            if (pos - told >= kHashChunk || pos == n) {
                {
                    std::lock_guard<std::mutex> lock(mu);
                    copied = pos;
                }
                cv.notify_all();
                told = pos;
            }
            pace(started, pos, max_rate);
        }
    } catch (...) {
        finish();
        throw;
    }
    finish();
    return true;
}

// Copies `n` bytes from `src` (at its offset) to `dst`, hashing them in order, where sendfile
// cannot be used. Two threads: this one read()s chunk k+1 while a helper hashes chunk k and
// write()s it, so the checksum costs no time next to a plain read-then-write copy. Chunks are small
// enough to stay in cache between the read and the hash. An error on either side stops both and is
// rethrown here.
void copy_and_hash(int src, int dst, uint64_t n, LoadDigest& digest, const std::string& name, const std::string& path,
                   uint64_t needed, uint64_t max_rate) {
    auto started = std::chrono::steady_clock::now();
    struct Slot {
        std::unique_ptr<unsigned char[]> buf{new unsigned char[kChunk]};
        size_t size = 0;
    };
    Slot slots[kSlots];
    std::mutex mu;
    std::condition_variable cv;
    uint64_t filled = 0;   // chunks read so far (written by this thread)
    uint64_t drained = 0;  // chunks hashed and written (by the helper)
    bool done = false;     // no more chunks will be read
    bool failed = false;   // one side failed: the other stops
    std::exception_ptr error;

    std::thread writer([&] {
        try {
            for (uint64_t k = 0;; ++k) {
                {
                    std::unique_lock<std::mutex> lock(mu);
                    cv.wait(lock, [&] { return failed || filled > k || done; });
                    if (failed || filled <= k) return;
                }
                Slot& slot = slots[k % kSlots];
                digest.update(slot.buf.get(), slot.size);
                write_full(dst, slot.buf.get(), slot.size, name, path, needed);
                {
                    std::lock_guard<std::mutex> lock(mu);
                    drained = k + 1;
                }
                cv.notify_all();
            }
        } catch (...) {
            std::lock_guard<std::mutex> lock(mu);
            error = std::current_exception();
            failed = true;
            cv.notify_all();
        }
    });
    auto finish = [&] {
        {
            std::lock_guard<std::mutex> lock(mu);
            done = true;
        }
        cv.notify_all();
        writer.join();
    };
    try {
        uint64_t pos = 0;
        for (uint64_t k = 0; pos < n; ++k) {
            {
                std::unique_lock<std::mutex> lock(mu);
                cv.wait(lock, [&] { return failed || k - drained < kSlots; });
                if (failed) break;
            }
            Slot& slot = slots[k % kSlots];
            size_t want = static_cast<size_t>(std::min<uint64_t>(kChunk, n - pos));
            size_t got = read_full(src, slot.buf.get(), want, path);
            if (got != want) throw_shrank(path, pos + got, n);
            slot.size = got;
            pos += got;
            pace(started, pos, max_rate);
            {
                std::lock_guard<std::mutex> lock(mu);
                filled = k + 1;
            }
            cv.notify_all();
        }
    } catch (...) {
        {
            std::lock_guard<std::mutex> lock(mu);
            failed = true;
        }
        finish();
        throw;
    }
    finish();
    if (error) std::rethrow_exception(error);
}

}  // namespace

ShmSpace shm_space(const std::string& dir) {
    struct statvfs st;
    if (::statvfs(dir.c_str(), &st) != 0) throw_errno("statvfs " + dir, errno);
    return {static_cast<uint64_t>(st.f_bavail) * st.f_frsize, static_cast<uint64_t>(st.f_blocks) * st.f_frsize};
}

void check_shm_room(uint64_t needed, uint64_t available, const std::string& label) {
    if (needed <= available) return;
    uint64_t gib = (needed + (uint64_t{1} << 30) - 1) >> 30;
    std::string size = std::to_string(gib + gib / 4 + 1) + "g";  // some headroom for a second generation
    throw Error(
        Error::Kind::Shm,
        label + ": not enough shared memory: loading it needs " + human(needed) + " (" + std::to_string(needed) +
            " bytes) in " + kShmDir + ", but only " + human(available) + " is available. " + kShmDir +
            " is a tmpfs and containers often get only 64 MiB. Give it more room: docker run --shm-size=" + size +
            " (or --ipc=host to use the host's); in Kubernetes mount an emptyDir with medium: Memory "
            "and sizeLimit: " +
            std::to_string(gib + gib / 4 + 1) + "Gi at " + kShmDir + "; on a host, mount -o remount,size=" + size +
            " " + kShmDir + ". Or read the file directly: mode=\"mmap\".",
        ENOSPC);
}

LoadedSegment load_segment(const std::string& path, const std::string& name, const LoadOptions& options) {
    // O_NONBLOCK: a FIFO must not block the daemon; it is refused below as not a regular file.
    Fd src{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)};
    if (src.fd < 0) throw_errno(path, errno);
    struct stat st;
    if (::fstat(src.fd, &st) != 0) throw_errno(path, errno);
    if (!S_ISREG(st.st_mode)) throw Error(Error::Kind::Format, path + ": not a regular file");
    auto size = static_cast<uint64_t>(st.st_size);
    if (size < kHeaderSize) {
        throw Error(Error::Kind::Truncated, path + ": truncated or not an smstore blob: file is " +
                                                std::to_string(size) + " bytes, shorter than the header");
    }
    ::posix_fadvise(src.fd, 0, 0, POSIX_FADV_SEQUENTIAL);

    // Refuse foreign and malformed files before anything is created.
    unsigned char header[kHeaderSize];
    if (read_full(src.fd, header, kHeaderSize, path) != kHeaderSize) {
        throw Error(Error::Kind::Truncated, path + ": truncated while reading the header");
    }
    Header h;
    std::memcpy(&h, header, sizeof h);
    validate_header(h, size, path);

    uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    uint64_t needed = (size + page - 1) / page * page;
    uint64_t available = shm_space(options.shm_dir).available;
    if (options.room_limit > 0 && options.room_limit < available) available = options.room_limit;
    check_shm_room(needed, available, path);

    // Writable by the owner only while loading; the final (read-only) mode is set at the end.
    Fd seg{::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600)};
    if (seg.fd < 0) throw_errno("shm_open " + name, errno);
    SegmentGuard guard{name};
    if (::fchmod(seg.fd, 0600) != 0) throw_errno("fchmod " + name, errno);

    // Every page is written, so the segment has no holes and a reader can never fault on one;
    // tmpfs allocates pages at write(), so a full /dev/shm is ENOSPC here, not SIGBUS later.
    // (posix_fallocate would also reserve the pages, but zeroes each one before we overwrite it.)
    write_full(seg.fd, header, kHeaderSize, name, path, needed);
    LoadDigest digest{BlobHasher{}, IndexChecker{h}};
    if (!options.sendfile ||
        !sendfile_and_hash(src.fd, seg.fd, size - kHeaderSize, digest, name, path, needed, options.max_rate)) {
        copy_and_hash(src.fd, seg.fd, size - kHeaderSize, digest, name, path, needed, options.max_rate);
    }
    unsigned char extra;
    if (read_full(src.fd, &extra, 1, path) != 0) {
        throw Error(Error::Kind::Format, path + ": file grew while it was being loaded; was it rewritten in place?");
    }
    check_checksum(h.checksum, digest.hash.finish(header), path, " (not loaded)");
    digest.index.finish(path);

    if (options.gid >= 0 && ::fchown(seg.fd, static_cast<uid_t>(-1), static_cast<gid_t>(options.gid)) != 0) {
        throw_errno("fchown " + name + " to group " + std::to_string(options.gid), errno);
    }
    if (::fchmod(seg.fd, options.mode) != 0) throw_errno("fchmod " + name, errno);
    // Hand out a read-only descriptor: clients that receive it cannot map the segment writable.
    std::string self = "/proc/self/fd/" + std::to_string(seg.fd);
    int ro = ::open(self.c_str(), O_RDONLY | O_CLOEXEC);
    if (ro < 0) throw_errno("reopen " + name + " read-only", errno);
    guard.keep = true;
    return {ro, size, h.checksum, h.record_count};
}

bool unlink_segment(const std::string& name) {
    if (::shm_unlink(name.c_str()) == 0) return true;
    if (errno == ENOENT) return false;
    throw_errno("shm_unlink " + name, errno);
}

}  // namespace smstore
