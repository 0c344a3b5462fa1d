// One exception type for the whole core; the bindings map each Kind to one Python class.
#pragma once

#include <stdexcept>
#include <string>

namespace smstore {

class Error : public std::runtime_error {
public:
    enum class Kind {
        Format,     // structurally malformed or foreign file
        Truncated,  // file shorter than its header says
        Version,    // a format version or feature this build does not read
        Checksum,   // stored checksum does not match the contents
        NotFound,   // the path does not exist
        Io,         // an operating-system call failed
        Input,      // bad input to pack (e.g. an invalid JSON line)
        Shm,        // shared-memory segment problem (room, permissions, missing)
        Closed,     // the object was closed, finished or never initialized: it cannot be used
        Index,      // a record index outside the store
    };

    Error(Kind kind, const std::string& message, int sys_errno = 0)
        : std::runtime_error(message), kind_(kind), errno_(sys_errno) {}

    Kind kind() const noexcept { return kind_; }
    int sys_errno() const noexcept { return errno_; }

private:
    Kind kind_;
    int errno_;
};

// "what: strerror(errno)", with the error kind chosen from errno (ENOENT -> NotFound).
[[noreturn]] void throw_errno(const std::string& what, int err);

}  // namespace smstore
