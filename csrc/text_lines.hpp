// `smstore pack --format lines|jsonl`: text lines -> one record per line.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "line_scanner.hpp"
#include "writer.hpp"

namespace smstore {

enum class LineFormat { Lines, Jsonl };

// Streams text files (or "-" for stdin) into `writer`: record i is line i without its '\n'; a final
// line without '\n' is a record; every other byte is kept. Jsonl validates each line as JSON and
// throws Error(Input) naming the file and line, or a line longer than max_line (which it must hold
// whole); lines of any length stream through. Returns the bytes read.
uint64_t pack_lines(Writer& writer, const std::vector<InputSpan>& inputs, LineFormat format, PackProgress* progress,
                    uint64_t max_line = kDefaultMaxLine);

}  // namespace smstore
