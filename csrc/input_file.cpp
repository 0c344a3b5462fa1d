// InputFile: open (refusing directories), advise sequential access, read with EINTR retries.
#include "input_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "error.hpp"

namespace smstore {

InputFile::InputFile(const InputSpan& span) : name_(span.name) {
    const std::string& name = span.name;
    if (span.end < span.start) throw Error(Error::Kind::Input, name + ": a part must not end before it starts");
    if (name == "-") {
        if (!span.whole()) throw Error(Error::Kind::Input, "<stdin>: cannot read a part of stdin");
        fd_ = 0;
        name_ = "<stdin>";
        return;
    }
    fd_ = ::open(name.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) throw_errno(name, errno);
    struct stat st;
    if (::fstat(fd_, &st) == 0 && S_ISDIR(st.st_mode)) {
        ::close(fd_);
        throw Error(Error::Kind::Io, name + ": is a directory");
    }
    if (!span.whole()) {
        if (::lseek(fd_, static_cast<off_t>(span.start), SEEK_SET) < 0) {
            int err = errno;
            ::close(fd_);
            throw_errno(name + ": cannot seek to byte " + std::to_string(span.start), err);
        }
        left_ = span.end - span.start;
        if (span.start > 0) name_ = name + " (part from byte " + std::to_string(span.start) + ")";
    }
    ::posix_fadvise(fd_, static_cast<off_t>(span.start), 0, POSIX_FADV_SEQUENTIAL);
}

InputFile::~InputFile() {
    if (fd_ > 0) ::close(fd_);  // never close stdin
}

size_t InputFile::read(void* buf, size_t size) {
    if (size > left_) size = static_cast<size_t>(left_);
    if (size == 0) return 0;
    for (;;) {
        ssize_t n = ::read(fd_, buf, size);
        if (n >= 0) {
            if (left_ != InputSpan::kToEnd) left_ -= static_cast<uint64_t>(n);
            return static_cast<size_t>(n);
        }
        if (errno != EINTR) throw_errno(name_ + ": read failed", errno);
    }
}

}  // namespace smstore
