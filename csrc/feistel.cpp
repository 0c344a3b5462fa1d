// Feistel: the round keys (BLAKE2b, RFC 7693), the round widths and masks, and the batch form of the permutation.
#include "feistel.hpp"

#include <cstring>
#include <stdexcept>

namespace smstore {

namespace {
uint64_t mask(unsigned width) {
    return width >= 64 ? ~uint64_t{0} : (uint64_t{1} << width) - 1;
}

constexpr uint64_t kBlakeIV[8] = {0x6A09E667F3BCC908ULL, 0xBB67AE8584CAA73BULL, 0x3C6EF372FE94F82BULL,
                                  0xA54FF53A5F1D36F1ULL, 0x510E527FADE682D1ULL, 0x9B05688C2B3E6C1FULL,
                                  0x1F83D9ABFB41BD6BULL, 0x5BE0CD19137E2179ULL};
constexpr uint8_t kSigma[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4}, {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13}, {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11}, {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5}, {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}, {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

uint64_t rotr(uint64_t x, unsigned n) {
    return (x >> n) | (x << (64 - n));
}

uint64_t load_le(const unsigned char* p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; --i)
        v = (v << 8) | p[i];
    return v;
}

// BLAKE2b's compression of one 128-byte block into h (`bytes`: the input so far, this block included).
void blake2b_compress(uint64_t h[8], const unsigned char* block, uint64_t bytes, bool last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; ++i)
        m[i] = load_le(block + 8 * i);
    for (int i = 0; i < 8; ++i) {
        v[i] = h[i];
        v[i + 8] = kBlakeIV[i];
    }
    v[12] ^= bytes;  // the counter's high word stays 0: keys are far below 2^64 bytes
    if (last) v[14] = ~v[14];
    auto g = [&v](int a, int b, int c, int d, uint64_t x, uint64_t y) {
        v[a] = v[a] + v[b] + x;
        v[d] = rotr(v[d] ^ v[a], 32);
        v[c] = v[c] + v[d];
        v[b] = rotr(v[b] ^ v[c], 24);
        v[a] = v[a] + v[b] + y;
        v[d] = rotr(v[d] ^ v[a], 16);
        v[c] = v[c] + v[d];
        v[b] = rotr(v[b] ^ v[c], 63);
    };
    for (const auto& s : kSigma) {
        g(0, 4, 8, 12, m[s[0]], m[s[1]]);
        g(1, 5, 9, 13, m[s[2]], m[s[3]]);
        g(2, 6, 10, 14, m[s[4]], m[s[5]]);
        g(3, 7, 11, 15, m[s[6]], m[s[7]]);
        g(0, 5, 10, 15, m[s[8]], m[s[9]]);
        g(1, 6, 11, 12, m[s[10]], m[s[11]]);
        g(2, 7, 8, 13, m[s[12]], m[s[13]]);
        g(3, 4, 9, 14, m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; ++i)
        h[i] ^= v[i] ^ v[i + 8];
}
}  // namespace

std::vector<uint64_t> feistel_round_keys(std::string_view key, unsigned rounds) {
    if (rounds == 0 || rounds > 8) throw std::invalid_argument("a Feistel permutation has 1 to 8 rounds");
    static constexpr char kPerson[16] = "smstore-feistel";  // 15 bytes and a zero: BLAKE2b's 16
    uint64_t h[8];
    std::memcpy(h, kBlakeIV, sizeof h);
    h[0] ^= 0x01010000ULL ^ (8 * rounds);  // digest of 8 * rounds bytes, no key, fanout and depth 1
    h[6] ^= load_le(reinterpret_cast<const unsigned char*>(kPerson));
    h[7] ^= load_le(reinterpret_cast<const unsigned char*>(kPerson) + 8);
    const auto* in = reinterpret_cast<const unsigned char*>(key.data());
    uint64_t left = key.size(), done = 0;
    for (; left > 128; in += 128, left -= 128) {
        done += 128;
        blake2b_compress(h, in, done, false);
    }
    unsigned char block[128] = {};
    if (left) std::memcpy(block, in, left);
    blake2b_compress(h, block, done + left, true);
    return std::vector<uint64_t>(h, h + rounds);  // the digest's words, read little-endian
}

Feistel::Feistel(uint64_t n, std::vector<uint64_t> round_keys) : n_(n) {
    if (n > (uint64_t{1} << 63)) throw std::invalid_argument("a Feistel permutation holds at most 2**63 values");
    // The smallest power of two >= n, and at least 4 (two bits: a half of each width).
    bits_ = 2;
    while (bits_ < 63 && (uint64_t{1} << bits_) < n)
        ++bits_;
    unsigned lo = bits_ / 2;
    rounds_.reserve(round_keys.size());
    for (uint64_t key : round_keys) {
        unsigned hi = bits_ - lo;
        rounds_.push_back(Round{key, lo, hi, mask(lo), mask(hi)});
        lo = hi;
    }
}

void Feistel::apply(const uint64_t* in, int64_t* out, size_t count) const noexcept {
    // Lanes of values go through each round together: one value's rounds are a chain of
    // dependent multiplies, and independent chains side by side keep the core busy (about twice
    // as fast as one value at a time). The few that land outside [0, n) then walk on alone.
    constexpr size_t kLanes = 8;
    size_t i = 0;
    for (; i + kLanes <= count; i += kLanes) {
        uint64_t x[kLanes];
        for (size_t j = 0; j < kLanes; ++j)
            x[j] = in[i + j];
        for (const Round& r : rounds_) {
            for (size_t j = 0; j < kLanes; ++j)
                x[j] = round(r, x[j]);
        }
        for (size_t j = 0; j < kLanes; ++j) {
            while (x[j] >= n_)
                x[j] = network(x[j]);
            out[i + j] = static_cast<int64_t>(x[j]);
        }
    }
    for (; i < count; ++i)
        out[i] = static_cast<int64_t>((*this)(in[i]));
}

}  // namespace smstore
