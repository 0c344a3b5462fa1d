// A sequential reader of one pack input: a file, or "-" for stdin.
#pragma once

#include <cstddef>
#include <string>

namespace smstore {

class InputFile {
public:
    // Opens `name` for sequential reading; "-" is stdin (named "<stdin>" in messages).
    explicit InputFile(const std::string& name);
    ~InputFile();
    InputFile(const InputFile&) = delete;
    InputFile& operator=(const InputFile&) = delete;

    // Up to `size` bytes; 0 at the end. Throws Error naming the input on failure.
    size_t read(void* buf, size_t size);
    const std::string& name() const noexcept { return name_; }

private:
    std::string name_;
    int fd_ = -1;
};

}  // namespace smstore
