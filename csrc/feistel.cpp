// Feistel: the round widths and masks, and the batch form of the permutation.
#include "feistel.hpp"

#include <stdexcept>

namespace smstore {

namespace {
uint64_t mask(unsigned width) {
    return width >= 64 ? ~uint64_t{0} : (uint64_t{1} << width) - 1;
}
}  // namespace

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
