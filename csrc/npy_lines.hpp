// `smstore pack --format npy-lines`: text lines of integers -> one fixed-dtype array record per line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "line_scanner.hpp"
#include "writer.hpp"

namespace smstore {

// An integer dtype as numpy names it: kind 'i' (signed) or 'u' (unsigned), itemsize 1, 2, 4 or 8.
struct IntDtype {
    char kind;
    int itemsize;
    std::string name() const;  // "uint16", "int32", ...
};

// Streams text files (or "-" for stdin) into `writer`: line i (without its '\n') holds
// whitespace-separated decimal integers and becomes record i, those integers as a little-endian
// array of `dtype` (an empty line is an empty array; a final line without '\n' is a record). A
// token that is not an integer, or a value outside the dtype's range, throws Error(Input) naming
// the file, line and column; so does a line longer than max_line bytes. Returns the bytes read.
uint64_t pack_npy_lines(Writer& writer, const std::vector<InputSpan>& inputs, IntDtype dtype, PackProgress* progress,
                        uint64_t max_line = kDefaultMaxLine);

}  // namespace smstore
