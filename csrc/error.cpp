// errno -> Error, with the kind chosen so that Python sees FileNotFoundError-like classes.
#include "error.hpp"

#include <cerrno>
#include <cstring>

namespace smstore {

void throw_errno(const std::string& what, int err) {
    Error::Kind kind = err == ENOENT ? Error::Kind::NotFound : Error::Kind::Io;
    throw Error(kind, what + ": " + std::strerror(err), err);
}

}  // namespace smstore
