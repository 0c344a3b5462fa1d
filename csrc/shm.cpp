// Loading blobs into POSIX shared memory: the room is checked and the pages reserved up front, so a
// full /dev/shm is an error at load time and never a SIGBUS in a reader later.
#include "shm.hpp"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <system_error>
#include <thread>

#include "error.hpp"
#include "format.hpp"

namespace smstore {
namespace {

// What one read() and one write() move. Small enough that a chunk is still in cache when it is
// hashed, and that one write() is short: a kernel built without preemption (PREEMPT_NONE, common on
// servers and VMs) cannot give the core to a training process inside the call, and the VM allocates
// tmpfs pages slowly (1 MiB a call held a core up to 4 ms on a 2-core VM; a rank woken there waited).
constexpr size_t kChunk = size_t{128} << 10;
constexpr size_t kPage = 4096;
// Chunks waiting that wake the helper thread: it hashes them in one go (a wake-up costs more than
// hashing a chunk, and one per chunk took 15 % more CPU time than a load on one thread).
constexpr size_t kBatch = 8;
// Chunks waiting from which the copying thread hashes the oldest itself: the helper has no core.
// Enough for the helper to be off its CPU for one scheduler slice of a busy neighbour (~3 MiB here)
// without the copier taking its work: on a 2-core VM with the other core busy, 6 chunks gave the
// copier 10-25 % of the hashing and the load 0.93x cp, 24 gave it ~5 % and 0.97x (one run each).
constexpr size_t kBehind = 24;
// Chunks read but not hashed yet, at most: the ring of buffers between reading and hashing (4 MiB).
constexpr size_t kSlots = 32;

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

// The chunks of a load between read() and the checksum, hashed in order by whichever thread has
// time: a helper thread when a core is free (woken for kBatch chunks at a time), else the copying
// thread itself, as soon as kBehind chunks wait. So the checksum never waits for a spare core (the copying thread
// alone is read, hash, write: cp plus the hash), and costs the copy no time where a core is free.
// Each chunk is hashed from the buffer it was written from, a few chunks after its read(): in
// cache, and exactly the bytes the segment got.
class HashRing {
public:
    // helper: false hashes every chunk on the copying thread, as soon as it is read.
    HashRing(LoadDigest& digest, bool helper) : digest_(digest), ring_(helper ? kSlots : 1) {
        for (size_t i = 0; i < ring_; ++i) {
            // Page-aligned: read() and write() copy whole pages to and from it (3 % faster here).
            slots_[i].reset(static_cast<unsigned char*>(std::aligned_alloc(kPage, kChunk)));
            if (!slots_[i]) throw std::bad_alloc();
        }
        if (!helper || !split_cpus()) return;
        try {
            helper_ = std::thread([this] { run(); });
        } catch (const std::system_error&) {
            unpin();  // no thread to be had: the copying thread hashes everything, wherever it runs
        } catch (...) {
            unpin();  // the destructor does not run for a constructor that throws
            throw;
        }
    }
    HashRing(const HashRing&) = delete;
    HashRing& operator=(const HashRing&) = delete;
    // After a failure: stops the helper; chunks not hashed yet are dropped with the load.
    ~HashRing() { stop(); }

    // The buffer for chunk k, once the chunk that used it before is hashed (here, if no one is at it).
    unsigned char* slot(uint64_t k) {
        std::unique_lock<std::mutex> lock(mu_);
        if (filled_ - hashed_ >= kBehind) hash_next(lock);  // the helper has no core: hashed while in cache
        while (k - hashed_ >= ring_) {
            if (!hash_next(lock)) cv_.wait(lock);
        }
        return slots_[k % ring_].get();
    }

    // Chunk k (the one after the last) holds `size` bytes; they must not change until its slot is handed out again.
    void filled(uint64_t k, size_t size) {
        std::unique_lock<std::mutex> lock(mu_);
        sizes_[k % ring_] = size;
        filled_ = k + 1;
        if (!helper_.joinable()) {
            hash_next(lock);
            return;
        }
        if (filled_ - hashed_ != kBatch) return;  // the helper is at it, or has too little to wake for
        lock.unlock();
        cv_.notify_all();
    }

    // Hashes what is left (with the helper, if it is at it), then stops the helper.
    void finish() {
        {
            std::unique_lock<std::mutex> lock(mu_);
            while (hashed_ < filled_) {
                if (!hash_next(lock)) cv_.wait(lock);
            }
        }
        stop();
    }

private:
    // Hashes the oldest chunk not hashed unless someone is hashing one (the checksum is sequential)
    // or none is waiting; false if it did not. Called with the lock held, which it drops meanwhile.
    bool hash_next(std::unique_lock<std::mutex>& lock) {
        if (hashing_ || hashed_ == filled_) return false;
        hashing_ = true;
        uint64_t k = hashed_;
        lock.unlock();
        digest_.update(slots_[k % ring_].get(), sizes_[k % ring_]);
        lock.lock();
        hashing_ = false;
        hashed_ = k + 1;
        cv_.notify_all();
        return true;
    }

    // Keeps the copying thread on the CPU it runs on and the helper off it, for the load: woken by
    // the copier, the helper would otherwise be queued behind it on its CPU (the kernel's wake-up
    // places it there) and hash nothing while the copier runs, where another CPU, even a busy one,
    // gives it a share. False (no helper) if this thread may run on one CPU only.
    bool split_cpus() {
        int cpu = ::sched_getcpu();
        if (cpu < 0 || ::sched_getaffinity(0, sizeof copier_was_, &copier_was_) != 0) return false;
        if (!CPU_ISSET(cpu, &copier_was_) || CPU_COUNT(&copier_was_) < 2) return false;
        helper_cpus_ = copier_was_;
        CPU_CLR(cpu, &helper_cpus_);
        cpu_set_t here;
        CPU_ZERO(&here);
        CPU_SET(cpu, &here);
        pinned_ = ::sched_setaffinity(0, sizeof here, &here) == 0;
        return true;
    }

    void run() {
        ::sched_setaffinity(0, sizeof helper_cpus_, &helper_cpus_);  // best effort: a refusal only costs speed
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
            cv_.wait(lock, [this] { return stopping_ || (!hashing_ && filled_ - hashed_ >= kBatch); });
            if (stopping_) return;
            while (hash_next(lock)) {
            }
        }
    }

    // Gives the copying thread back the CPUs it had before the load.
    void unpin() {
        if (pinned_) {
            ::sched_setaffinity(0, sizeof copier_was_, &copier_was_);
            pinned_ = false;
        }
    }

    void stop() {
        unpin();
        if (!helper_.joinable()) return;
        {
            std::lock_guard<std::mutex> lock(mu_);
            stopping_ = true;
        }
        cv_.notify_all();
        helper_.join();
    }

    LoadDigest& digest_;
    const size_t ring_;  // slots in use: kSlots with a helper, else the one in cache
    struct Free {
        void operator()(unsigned char* p) const noexcept { std::free(p); }
    };
    std::unique_ptr<unsigned char, Free> slots_[kSlots];
    size_t sizes_[kSlots] = {};
    std::mutex mu_;
    std::condition_variable cv_;
    uint64_t filled_ = 0;    // chunks read (and handed over) so far
    uint64_t hashed_ = 0;    // chunks hashed so far
    bool hashing_ = false;   // a thread is hashing chunk hashed_
    bool stopping_ = false;  // the helper leaves
    cpu_set_t copier_was_;   // the copying thread's CPUs before the load, given back by stop()
    cpu_set_t helper_cpus_;  // those CPUs but the one the copying thread is kept on
    bool pinned_ = false;    // the copying thread is kept on one CPU until stop()
    std::thread helper_;     // started last: it reads the members above
};

// Copies `n` bytes from `src` (at its offset) to `dst` with read() and write() through the hash
// ring: one copy into a buffer that stays in cache, the checksum from it, one copy into the
// segment. (sendfile copies once, but then the checksum has to read the segment back, through a
// mapping whose page faults and teardown cost more than the copy saved: 0.71x cp against 0.91x
// for one thread doing read, hash, write, on a 2-core VM with one core busy.)
void copy_and_hash(int src, int dst, uint64_t n, LoadDigest& digest, const std::string& name, const std::string& path,
                   uint64_t needed, uint64_t max_rate, bool hash_thread) {
    auto started = std::chrono::steady_clock::now();
    HashRing ring(digest, hash_thread);
    uint64_t pos = 0;
    for (uint64_t k = 0; pos < n; ++k) {
        unsigned char* buf = ring.slot(k);
        size_t want = static_cast<size_t>(std::min<uint64_t>(kChunk, n - pos));
        size_t got = read_full(src, buf, want, path);
        if (got != want) throw_shrank(path, pos + got, n);
        ring.filled(k, got);  // the helper hashes it while this thread writes it
        write_full(dst, buf, got, name, path, needed);
        pos += got;
        pace(started, pos, max_rate);
    }
    ring.finish();
}

}  // namespace

ShmSpace shm_space(const std::string& dir) {
    struct statvfs st;
    if (::statvfs(dir.c_str(), &st) != 0) throw_errno("statvfs " + dir, errno);
    return {static_cast<uint64_t>(st.f_bavail) * st.f_frsize, static_cast<uint64_t>(st.f_blocks) * st.f_frsize};
}

uint64_t shm_footprint(uint64_t size) {
    static const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    return (size + page - 1) / page * page;
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

    uint64_t needed = shm_footprint(size);
    uint64_t available = shm_space(options.shm_dir).available;
    if (options.room_limit > 0 && options.room_limit < available) available = options.room_limit;
    check_shm_room(needed, available, path);

    // Writable by the owner only while loading; the final (read-only) mode is set at the end.
    Fd seg{create_segment(name)};
    SegmentGuard guard{name};

    // Every page is written, so the segment has no holes and a reader can never fault on one;
    // tmpfs allocates pages at write(), so a full /dev/shm is ENOSPC here, not SIGBUS later.
    // (posix_fallocate would also reserve the pages, but zeroes each one before we overwrite it.)
    write_full(seg.fd, header, kHeaderSize, name, path, needed);
    LoadDigest digest{BlobHasher{}, IndexChecker{h}};
    copy_and_hash(src.fd, seg.fd, size - kHeaderSize, digest, name, path, needed, options.max_rate,
                  options.hash_thread);
    unsigned char extra;
    if (read_full(src.fd, &extra, 1, path) != 0) {
        throw Error(Error::Kind::Format, path + ": file grew while it was being loaded; was it rewritten in place?");
    }
    check_checksum(h.checksum, digest.hash.finish(header), path, " (not loaded)");
    digest.index.finish(path);

    int ro = seal_segment(seg.fd, name, options.mode, options.gid);
    guard.keep = true;
    return {ro, size, h.checksum, h.record_count};
}

int create_segment(const std::string& name) {
    int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) throw_errno("shm_open " + name, errno);
    // The umask may have taken bits from 0600; the owner must be able to write until it is sealed.
    if (::fchmod(fd, 0600) != 0) {
        int err = errno;
        ::close(fd);
        ::shm_unlink(name.c_str());
        throw_errno("fchmod " + name, err);
    }
    return fd;
}

int seal_segment(int fd, const std::string& name, mode_t mode, int64_t gid) {
    if (gid >= 0 && ::fchown(fd, static_cast<uid_t>(-1), static_cast<gid_t>(gid)) != 0) {
        throw_errno("fchown " + name + " to group " + std::to_string(gid), errno);
    }
    if (::fchmod(fd, mode) != 0) throw_errno("fchmod " + name, errno);
    // Hand out a read-only descriptor: clients that receive it cannot map the segment writable.
    std::string self = "/proc/self/fd/" + std::to_string(fd);
    int ro = ::open(self.c_str(), O_RDONLY | O_CLOEXEC);
    if (ro < 0) throw_errno("reopen " + name + " read-only", errno);
    return ro;
}

namespace {
constexpr int kSeals = F_SEAL_WRITE | F_SEAL_GROW | F_SEAL_SHRINK;
}  // namespace

int create_memfd(const std::string& name) {
    int fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) throw Error(Error::Kind::Shm, name + ": memfd_create failed: " + std::strerror(errno), errno);
    return fd;
}

int seal_memfd(int fd, const std::string& name) {
    // F_SEAL_SEAL last: nobody may remove or add a seal after these.
    if (::fcntl(fd, F_ADD_SEALS, kSeals | F_SEAL_SEAL) != 0) throw_errno("seal " + name, errno);
    std::string self = "/proc/self/fd/" + std::to_string(fd);
    int ro = ::open(self.c_str(), O_RDONLY | O_CLOEXEC);
    if (ro < 0) throw_errno("reopen " + name + " read-only", errno);
    return ro;
}

bool memfd_sealed(int fd) {
    int seals = ::fcntl(fd, F_GET_SEALS);
    return seals >= 0 && (seals & kSeals) == kSeals;
}

bool unlink_segment(const std::string& name) {
    if (::shm_unlink(name.c_str()) == 0) return true;
    if (errno == ENOENT) return false;
    throw_errno("shm_unlink " + name, errno);
}

}  // namespace smstore
