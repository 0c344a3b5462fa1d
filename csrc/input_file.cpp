// InputFile: open (refusing directories), advise sequential access, read with EINTR retries.
#include "input_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "error.hpp"

namespace smstore {

InputFile::InputFile(const std::string& name) : name_(name) {
    if (name == "-") {
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
    ::posix_fadvise(fd_, 0, 0, POSIX_FADV_SEQUENTIAL);
}

InputFile::~InputFile() {
    if (fd_ > 0) ::close(fd_);  // never close stdin
}

size_t InputFile::read(void* buf, size_t size) {
    for (;;) {
        ssize_t n = ::read(fd_, buf, size);
        if (n >= 0) return static_cast<size_t>(n);
        if (errno != EINTR) throw_errno(name_ + ": read failed", errno);
    }
}

}  // namespace smstore
