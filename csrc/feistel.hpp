// The keyed permutation behind the samplers' shuffles: a Feistel network with cycle-walking.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace smstore {

// A bijection of [0, n) that holds one 64-bit key per round and nothing else (see
// smstore.sampler.FeistelPermutation, which derives the keys and documents the construction).
// Each round maps the halves (A, B) of a bits()-wide value to (B, A xor F(B)), F being
// splitmix64's finalizer of B + key; the halves trade widths every round. Values the network sends
// to [n, 2^bits) go through it again until they land in [0, n).
// The round keys of the permutation keyed by `key`: `rounds` (at most 8) 64-bit words, little-endian,
// of the BLAKE2b digest of `key` (8 * rounds bytes, personalization "smstore-feistel"): the rule
// of smstore.sampling.orders.round_keys, which calls this.
std::vector<uint64_t> feistel_round_keys(std::string_view key, unsigned rounds = 6);

class Feistel {
public:
    Feistel(uint64_t n, std::vector<uint64_t> round_keys);

    uint64_t n() const noexcept { return n_; }
    unsigned bits() const noexcept { return bits_; }

    // The image of x, which must be < n() (a value outside may never walk back into range).
    uint64_t operator()(uint64_t x) const noexcept {
        do {
            x = network(x);
        } while (x >= n_);
        return x;
    }
    // out[i] = (*this)(in[i]); every in[i] must be < n().
    void apply(const uint64_t* in, int64_t* out, size_t count) const noexcept;

private:
    struct Round {
        uint64_t key;
        unsigned lo, hi;  // widths of the low half B and the high half A
        uint64_t lo_mask, hi_mask;
    };
    static uint64_t round(const Round& r, uint64_t x) noexcept {
        uint64_t b = x & r.lo_mask;
        uint64_t z = b + r.key;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        z ^= z >> 31;
        return (b << r.hi) | (((x >> r.lo) ^ z) & r.hi_mask);
    }
    uint64_t network(uint64_t x) const noexcept {
        for (const Round& r : rounds_)
            x = round(r, x);
        return x;
    }

    uint64_t n_;
    unsigned bits_;
    std::vector<Round> rounds_;
};

}  // namespace smstore
