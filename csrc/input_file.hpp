// A sequential reader of one pack input: a file, or "-" for stdin.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace smstore {

// A pack input: a whole file ("-" for stdin), or bytes [start, end) of a file, so that parts of one
// large file can be packed in parallel (each part starting at a line's first byte).
struct InputSpan {
    static constexpr uint64_t kToEnd = UINT64_MAX;
    InputSpan(std::string file) : name(std::move(file)) {}  // NOLINT: a name is a whole-file span
    InputSpan(std::string file, uint64_t from, uint64_t to) : name(std::move(file)), start(from), end(to) {}
    bool whole() const noexcept { return start == 0 && end == kToEnd; }

    std::string name;
    uint64_t start = 0;
    uint64_t end = kToEnd;
};

class InputFile {
public:
    // Opens `span` for sequential reading; "-" is stdin (named "<stdin>" in messages). A part of a
    // file is named "FILE (part from byte N)", and its line numbers count from that byte.
    explicit InputFile(const InputSpan& span);
    ~InputFile();
    InputFile(const InputFile&) = delete;
    InputFile& operator=(const InputFile&) = delete;

    // Up to `size` bytes; 0 at the end. Throws Error naming the input on failure.
    size_t read(void* buf, size_t size);
    const std::string& name() const noexcept { return name_; }

private:
    std::string name_;
    int fd_ = -1;
    uint64_t left_ = InputSpan::kToEnd;  // bytes of the span not read yet
};

}  // namespace smstore
