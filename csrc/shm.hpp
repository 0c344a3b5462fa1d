// POSIX shared-memory segments holding whole blobs: room checks, checksummed loading, unlinking.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace smstore {

// Where shm_open() puts its objects on Linux; statvfs() of it is the room a segment can use.
inline constexpr const char* kShmDir = "/dev/shm";

struct ShmSpace {
    uint64_t available;  // bytes an unprivileged user may still allocate
    uint64_t total;
};

// The room in the filesystem at `dir` (normally kShmDir).
ShmSpace shm_space(const std::string& dir);

// Bytes of shared memory a segment of `size` bytes takes: whole pages, as tmpfs allocates them.
// The one size rule for the daemon's --shm-limit and for everything that plans within it.
uint64_t shm_footprint(uint64_t size);

// Throws Error(Shm) saying how much `label` needs, how much is free and how to make room.
void check_shm_room(uint64_t needed, uint64_t available, const std::string& label);

struct LoadOptions {
    mode_t mode = 0400;       // final mode; 0400 or 0440: nobody may write a loaded segment
    int64_t gid = -1;         // >= 0: chown the segment to this group (with mode 0440)
    uint64_t room_limit = 0;  // > 0: pretend at most this many bytes are free (tests, quotas)
    uint64_t max_rate = 0;    // > 0: read the file at most this many bytes a second (a shared file system)
    bool hash_thread = true;  // a helper thread may hash while this one copies; false: this one hashes all
    std::string shm_dir = kShmDir;
};

struct LoadedSegment {
    int fd;  // read-only descriptor of the segment; the caller owns it
    uint64_t size;
    uint64_t checksum;
    uint64_t record_count;
};

// Creates segment `name` ("/..." as for shm_open) with O_EXCL, reserves its pages, reads `path`
// sequentially into it while hashing, and validates structure and checksum. On any failure the
// segment is unlinked and Error is thrown: nothing is left behind.
LoadedSegment load_segment(const std::string& path, const std::string& name, const LoadOptions& options);

// Creates segment `name` ("/..." as for shm_open) with O_EXCL, readable and writable by its owner
// only until seal_segment(); returns its descriptor (the caller owns it). Throws Error.
int create_segment(const std::string& name);

// Gives the segment open at `fd` (written in full) its final `mode` and, if `gid` >= 0, that group;
// returns a new read-only descriptor of it, the one handed to readers (the caller keeps `fd`).
int seal_segment(int fd, const std::string& name, mode_t mode, int64_t gid);

// Creates an anonymous segment (a memfd, shown as `name` in /proc/PID/fd and maps) that can be
// sealed; returns its descriptor (the caller owns it). Throws Error(Shm).
int create_memfd(const std::string& name);

// Seals the memfd at `fd` (written in full) against writes, growth and shrinking, for good;
// returns a new read-only descriptor of it, the one handed to readers (the caller keeps `fd`).
int seal_memfd(int fd, const std::string& name);

// Whether `fd` is a memfd sealed against writes, growth and shrinking: its bytes never change, so
// a reader may trust what it checked once. False for anything else (a file, a pipe, a bad fd).
bool memfd_sealed(int fd);

// shm_unlink(name); false if it did not exist, throws Error on any other failure.
bool unlink_segment(const std::string& name);

}  // namespace smstore
