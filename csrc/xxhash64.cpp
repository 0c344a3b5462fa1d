// XXH64 as specified by Yann Collet's xxHash (https://github.com/Cyan4973/xxHash, doc/xxhash_spec.md).
#include "xxhash64.hpp"

#include <cstring>

namespace smstore {
namespace {

constexpr uint64_t P1 = 0x9E3779B185EBCA87ULL;
constexpr uint64_t P2 = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t P3 = 0x165667B19E3779F9ULL;
constexpr uint64_t P4 = 0x85EBCA77C2B2AE63ULL;
constexpr uint64_t P5 = 0x27D4EB2F165667C5ULL;

inline uint64_t rotl(uint64_t x, int r) {
    return (x << r) | (x >> (64 - r));
}

inline uint64_t read64(const unsigned char* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
}

inline uint32_t read32(const unsigned char* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

inline uint64_t round(uint64_t acc, uint64_t input) {
    acc += input * P2;
    acc = rotl(acc, 31);
    return acc * P1;
}

inline uint64_t merge_round(uint64_t acc, uint64_t val) {
    acc ^= round(0, val);
    return acc * P1 + P4;
}

}  // namespace

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "smstore reads and writes little-endian blobs natively");

Xxh64::Xxh64(uint64_t seed) noexcept : seed_(seed) {
    v_[0] = seed + P1 + P2;
    v_[1] = seed + P2;
    v_[2] = seed;
    v_[3] = seed - P1;
}

void Xxh64::update(const void* data, size_t len) noexcept {
    auto p = static_cast<const unsigned char*>(data);
    const unsigned char* const end = p + len;
    total_len_ += len;

    if (mem_size_ + len < 32) {
        if (len) std::memcpy(mem_ + mem_size_, p, len);
        mem_size_ += len;
        return;
    }
    if (mem_size_) {
        size_t fill = 32 - mem_size_;
        std::memcpy(mem_ + mem_size_, p, fill);
        for (int i = 0; i < 4; ++i)
            v_[i] = round(v_[i], read64(mem_ + 8 * i));
        p += fill;
        mem_size_ = 0;
    }
    uint64_t v0 = v_[0], v1 = v_[1], v2 = v_[2], v3 = v_[3];
    while (end - p >= 32) {
        v0 = round(v0, read64(p));
        v1 = round(v1, read64(p + 8));
        v2 = round(v2, read64(p + 16));
        v3 = round(v3, read64(p + 24));
        p += 32;
    }
    v_[0] = v0, v_[1] = v1, v_[2] = v2, v_[3] = v3;
    if (p < end) {
        mem_size_ = static_cast<size_t>(end - p);
        std::memcpy(mem_, p, mem_size_);
    }
}

uint64_t Xxh64::digest() const noexcept {
    uint64_t h;
    if (total_len_ >= 32) {
        h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
        for (int i = 0; i < 4; ++i)
            h = merge_round(h, v_[i]);
    } else {
        h = seed_ + P5;
    }
    h += total_len_;

    const unsigned char* p = mem_;
    const unsigned char* const end = mem_ + mem_size_;
    while (end - p >= 8) {
        h ^= round(0, read64(p));
        h = rotl(h, 27) * P1 + P4;
        p += 8;
    }
    if (end - p >= 4) {
        h ^= static_cast<uint64_t>(read32(p)) * P1;
        h = rotl(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= static_cast<uint64_t>(*p) * P5;
        h = rotl(h, 11) * P1;
        ++p;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

}  // namespace smstore
