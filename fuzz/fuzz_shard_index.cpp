// libFuzzer target: ShardIndex::locate() (reciprocal, buckets, binary search) against a plain binary
// search over the prefix sums, for shard size lists read from the input (docs/fuzzing.md).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "shard_index.hpp"

namespace {

// The bytes of one input, read front to back; reads past the end give zeros.
struct Input {
    const uint8_t* p;
    size_t left;
    bool empty() const { return left == 0; }
    uint8_t byte() {
        if (!left) return 0;
        --left;
        return *p++;
    }
    uint64_t u64() {
        uint64_t v = 0;
        for (int b = 0; b < 8; ++b)
            v |= uint64_t{byte()} << (8 * b);
        return v;
    }
};

[[noreturn]] void finding(const char* what, uint64_t i, size_t got_k, uint64_t got_j, size_t want_k, uint64_t want_j) {
    std::fprintf(stderr, "Finding: %s: locate(%llu) = (%zu, %llu), binary search says (%zu, %llu)\n", what,
                 static_cast<unsigned long long>(i), got_k, static_cast<unsigned long long>(got_j), want_k,
                 static_cast<unsigned long long>(want_j));
    std::abort();
}

// One shard size: a byte b < 0xf0 is b records; 0xf0 + s reads a u64 and keeps its low 4s+4 bits
// (0xff: all 64), so sizes near 2^64 and of every magnitude between come up.
uint64_t shard_size(Input& in) {
    uint8_t b = in.byte();
    if (b < 0xf0) return b;
    unsigned bits = b == 0xff ? 64 : 4 * (b - 0xf0) + 4;
    uint64_t v = in.u64();
    return bits == 64 ? v : v & ((uint64_t{1} << bits) - 1);
}

// The prefix sums the input describes (flags in byte 0). Bit 0: shards of one size and a last no
// larger (the reciprocal path): the size, a count byte and the last size follow. Bit 1: the rest is
// raw u64 starts, which may be invalid. Otherwise a list of shard sizes. Sizes that would carry the
// total past 2^64 - 1 end the list. `valid` says whether ShardIndex must accept them.
std::vector<uint64_t> read_starts(Input& in, bool& valid) {
    uint8_t flags = in.byte();
    std::vector<uint64_t> starts{0};
    valid = true;
    auto push = [&starts](uint64_t size) {
        uint64_t end;
        if (__builtin_add_overflow(starts.back(), size, &end)) return false;
        starts.push_back(end);
        return true;
    };
    if (flags & 2) {
        starts.clear();
        while (!in.empty() && starts.size() < 4096)
            starts.push_back(in.u64());
        valid = !starts.empty() && starts[0] == 0;
        for (size_t k = 1; valid && k < starts.size(); ++k)
            valid = starts[k] >= starts[k - 1];
        return starts;
    }
    if (flags & 1) {
        uint64_t per = shard_size(in);
        unsigned count = in.byte();
        for (unsigned k = 0; k < count && push(per);)
            ++k;
        push(std::min(per, shard_size(in)));
        return starts;
    }
    while (!in.empty() && starts.size() < 4096 && push(shard_size(in))) {
    }
    return starts;
}

void check(const smstore::ShardIndex& index, const std::vector<uint64_t>& starts, uint64_t i) {
    if (i >= index.size()) return;
    // The last shard whose first record is at or before i: the one holding i, never an empty one.
    auto it = std::upper_bound(starts.begin(), starts.end(), i);
    auto want_k = static_cast<size_t>(it - starts.begin() - 1);
    uint64_t want_j = i - starts[want_k];
    auto [k, j] = index.locate(i);
    if (k != want_k || j != want_j) finding("wrong shard or offset", i, k, j, want_k, want_j);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    Input in{data, size};
    bool valid = true;
    std::vector<uint64_t> starts = read_starts(in, valid);
    bool accepted = true;
    try {
        smstore::ShardIndex index(starts);
        if (index.size() != starts.back() || index.shard_count() != starts.size() - 1) {
            finding("size or shard count differs", 0, index.shard_count(), index.size(), starts.size() - 1,
                    starts.back());
        }
        uint64_t n = index.size();
        // Every boundary and its neighbours, both ends, and some records spread over the whole range.
        for (uint64_t s : starts) {
            check(index, starts, s - 1);
            check(index, starts, s);
            check(index, starts, s + 1);
        }
        check(index, starts, n - 1);
        uint64_t x = 0x9e3779b97f4a7c15ULL ^ n;
        for (int r = 0; r < 64 && n; ++r) {
            x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64: deterministic per input
            check(index, starts, x % n);
        }
    } catch (const std::invalid_argument&) {
        accepted = false;
    }
    if (accepted != valid) {
        std::fprintf(stderr, "Finding: ShardIndex %s starts it should %s\n", accepted ? "accepted" : "refused",
                     valid ? "accept" : "refuse");
        std::abort();
    }
    return 0;
}
