// The order of a windowed epoch (smstore.sampler.WindowedOrder) evaluated in one pass: window,
// Feistel permutation within it, then shard and record, with no array of the epoch's size.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <vector>

#include "feistel.hpp"

namespace smstore {

// The strided form both orders offer (a rank's share of a pass): out[i] is the image of position
// (first + i * step) mod wrap, for i < count (a pass's padding wraps to the start of the order).
// Throws std::overflow_error if first + (count - 1) * step does not fit in 64 bits, and
// std::out_of_range if wrap is 0 or above the order's size while count is not 0.
void feistel_strided(const Feistel& perm, uint64_t first, uint64_t step, size_t count, uint64_t wrap, int64_t* out);

class WindowedOrder {
public:
    // The round keys of window j's permutation (derived by the caller, once per window).
    using KeySource = std::function<std::vector<uint64_t>(size_t window)>;

    // window_starts: G_0 = 0 <= G_1 <= ... <= G_W = n, the first position of each window.
    // seq_starts: S + 1 values, where each shard starts in the shards laid end to end in shard
    // order (non-decreasing, from 0 to n). record_starts: S values, the record index of each
    // shard's first record, in shard order. window: shards per window (the last may have fewer).
    // Throws std::invalid_argument if these disagree.
    WindowedOrder(std::vector<uint64_t> window_starts, std::vector<uint64_t> seq_starts,
                  std::vector<uint64_t> record_starts, size_t window, KeySource keys);

    uint64_t size() const noexcept { return window_starts_.back(); }
    size_t window_count() const noexcept { return window_starts_.size() - 1; }
    // The window holding position p (< size()); an empty window holds none.
    size_t window_of(uint64_t p) const noexcept;

    // The record at position p (< size(), unchecked), for positions that mostly rise (a mixture's
    // draws of one source): the window is searched for only when p leaves the last one.
    int64_t at(uint64_t p);
    // The record at each position; throws std::out_of_range for a position >= size().
    void apply(const uint64_t* in, int64_t* out, size_t count);
    void strided(uint64_t first, uint64_t step, size_t count, uint64_t wrap, int64_t* out);

private:
    const Feistel& perm(size_t j);
    int64_t image(uint64_t p, size_t j);
    int64_t image(uint64_t p, size_t j, const Feistel& f) const;

    std::vector<uint64_t> window_starts_, seq_starts_, record_starts_;
    size_t window_;
    KeySource keys_;
    std::unordered_map<size_t, Feistel> perms_;  // a few windows' (cleared past kMaxPerms)
    size_t cursor_ = 0;                          // at()'s last window
    const Feistel* cursor_perm_ = nullptr;       // and its permutation (perms_ keeps it, until cleared)
    static constexpr size_t kMaxPerms = 16;
};

}  // namespace smstore
