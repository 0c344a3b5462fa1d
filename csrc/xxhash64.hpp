// XXH64 (seed 0), streaming: the checksum of the blob format.
#pragma once

#include <cstddef>
#include <cstdint>

namespace smstore {

class Xxh64 {
public:
    explicit Xxh64(uint64_t seed = 0) noexcept;
    void update(const void* data, size_t len) noexcept;
    uint64_t digest() const noexcept;

private:
    uint64_t v_[4];
    uint64_t total_len_ = 0;
    unsigned char mem_[32];
    size_t mem_size_ = 0;
    uint64_t seed_;
};

}  // namespace smstore
