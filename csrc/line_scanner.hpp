// The one read loop behind every text packer: stream pack inputs line by line.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "error.hpp"
#include "input_file.hpp"

namespace smstore {

struct PackProgress {
    // Called every few MiB of input with the bytes read so far; may throw to cancel.
    virtual void update(uint64_t bytes_read) = 0;
    virtual ~PackProgress() = default;
};

// Reads `inputs` in order (files, or "-" for stdin) and hands every line to `on_piece` as it is
// read, never holding a line whole: on_piece(file, line_no, data, size, starts, ends) receives
// consecutive pieces of line `line_no` (1-based within its file); `starts` marks a line's first
// piece and `ends` its last. A line ends at its '\n' (not passed on) or at the end of its file;
// an unterminated last line ends with an empty piece. Reports progress every 32 MiB and returns
// the bytes read.
template <typename OnPiece>
uint64_t scan_lines(const std::vector<InputSpan>& inputs, PackProgress* progress, OnPiece&& on_piece) {
    constexpr size_t kReadSize = 256 << 10;  // stays in L2 on its way into the writer's buffer
    constexpr uint64_t kProgressEvery = 32 << 20;
    std::vector<char> buf(kReadSize);
    uint64_t total = 0, next_report = kProgressEvery;
    for (const auto& span : inputs) {
        InputFile in(span);
        uint64_t line_no = 1;
        bool open_line = false;  // a piece of the current line has been handed on
        for (size_t n; (n = in.read(buf.data(), buf.size())) != 0;) {
            total += n;
            const char* p = buf.data();
            const char* end = p + n;
            while (p < end) {
                auto nl = static_cast<const char*>(std::memchr(p, '\n', static_cast<size_t>(end - p)));
                const char* stop = nl ? nl : end;
                on_piece(in.name(), line_no, p, static_cast<size_t>(stop - p), !open_line, nl != nullptr);
                if (nl) {
                    ++line_no;
                    open_line = false;
                    p = nl + 1;
                } else {
                    open_line = true;
                    p = end;
                }
            }
            if (progress && total >= next_report) {
                progress->update(total);
                next_report = total + kProgressEvery;
            }
        }
        if (open_line) on_piece(in.name(), line_no, buf.data(), 0, false, true);
    }
    if (progress) progress->update(total);
    return total;
}

// The longest line a packer that parses lines whole (jsonl, npy-lines) accepts by default. Such a
// line is held in memory: a line without end (packing /dev/zero) must end in a clear error.
inline constexpr uint64_t kDefaultMaxLine = uint64_t{1} << 30;

// Joins scan_lines' pieces into whole lines, copying only the lines that span reads. A line longer
// than max_line bytes throws Error(Input) naming its file and line, and never holds more memory
// than max_line.
class LineJoiner {
public:
    explicit LineJoiner(uint64_t max_line) : max_line_(max_line) {}

    // Takes one piece; when it ends a line, returns true with [data, data + size) the whole line
    // (valid until the next call).
    bool add(const std::string& file, uint64_t line_no, const char*& data, size_t& size, bool starts, bool ends) {
        if (starts && ends) {  // the common case: the line lay within one read
            if (size > max_line_) too_long(file, line_no);
            return true;
        }
        if (starts) pending_.clear();
        if (size > max_line_ - pending_.size()) too_long(file, line_no);
        if (pending_.size() + size > pending_.capacity()) {
            // Geometric growth, capped at the limit: the limit bounds memory, not only length.
            pending_.reserve(static_cast<size_t>(
                std::min<uint64_t>(max_line_, std::max<uint64_t>(2 * pending_.capacity(), pending_.size() + size))));
        }
        pending_.insert(pending_.end(), data, data + size);
        if (!ends) return false;
        data = pending_.data();
        size = pending_.size();
        return true;
    }

private:
    [[noreturn]] void too_long(const std::string& file, uint64_t line_no) const {
        throw Error(Error::Kind::Input, file + ":" + std::to_string(line_no) + ": line is longer than the " +
                                            std::to_string(max_line_) +
                                            "-byte limit for a line parsed whole; split it, or raise the "
                                            "limit with max_line_bytes");
    }

    uint64_t max_line_;
    std::vector<char> pending_;
};

}  // namespace smstore
