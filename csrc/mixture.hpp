// A mixture epoch's order (smstore.mixture): the split tree gives each position's source and draw
// number, then the source's own order for that draw's pass (a Feistel permutation, or a windowed
// order over its shards) gives the record.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "feistel.hpp"
#include "windowed_order.hpp"

namespace smstore {

// floor(n / d) for n < 2^63 and 2 <= d <= 2^31 by one multiply: with l = ceil(log2 d) and
// M = ceil(2^(63+l) / d) (which fits in 64 bits), n M / 2^(63+l) exceeds n / d by less than
// n / 2^(63+l) < 2^-l <= 1/d, too little to reach the next integer.
class SmallDivisor {
public:
    explicit SmallDivisor(uint64_t d);
    uint64_t divisor() const noexcept { return d_; }
    uint64_t quotient(uint64_t n) const noexcept {
        return static_cast<uint64_t>((static_cast<unsigned __int128>(n) * magic_) >> 64) >> shift_;
    }

private:
    uint64_t d_, magic_;
    unsigned shift_;  // l - 1: the shift past the product's high word
};

// The binary split tree of smstore.mixture.Mixture. Internal node j has share q[j], left share
// a[j] (0 < a < q <= 2^31) and children coded >= 0 (a node, built before j) or -(s + 1) (source
// s < sources). Of the first m positions reaching a node, L(m) = floor((m a + h) / q) go left,
// h = (q - 1) / 2: position m goes left when L(m + 1) > L(m), as the child's position L(m), else
// as its position m - L(m). With m = d q + r, L(m) = d a + floor((r a + h) / q), and position m
// goes left when (r a + h) mod q >= q - a; every value stays below 2^63 for m < 2^63 (m <= p,
// r a + h < 2^62 + 2^30), so 64-bit arithmetic is exact.
class MixtureTree {
public:
    // root: a node, or -(s + 1) for a single source. Throws std::invalid_argument if the tree is
    // not one (sizes, shares, children out of range or not built before their parent).
    MixtureTree(const std::vector<uint64_t>& a, const std::vector<uint64_t>& q, const std::vector<int64_t>& left,
                const std::vector<int64_t>& right, int64_t root, size_t sources);

    size_t sources() const noexcept { return sources_; }

    struct Draw {
        size_t source;
        uint64_t before;  // positions before p that drew from the source
    };
    // Positions descend kLanes at a time, level by level and without branches, so that the
    // lanes' multiply chains overlap (one position's descent is a chain of dependent multiplies,
    // and which way it goes at each level is a coin toss no predictor learns).
    static constexpr size_t kLanes = 16;
    // out[i] = the draw of position in[i], i < count <= kLanes; every in[i] must be < 2^63.
    void locate_lanes(const uint64_t* in, Draw* out, size_t count) const noexcept;
    // locate_lanes() over any count; throws std::out_of_range for a position >= 2^63.
    void locate(const uint64_t* in, int64_t* source, int64_t* before, size_t count) const;

private:
    // Nodes [0, internal) are the tree's; node internal + s stands for source s and loops on
    // itself (keep is all ones: its m stays), so lanes that reach a source early idle there.
    struct Node {
        SmallDivisor q;
        uint64_t a, h, left_from, qa;  // left_from = q - a, qa = q a (mod 2^64)
        uint64_t keep;
        uint32_t left, right;
    };
    std::vector<Node> nodes_;
    uint32_t internal_, root_;
    size_t sources_;
};

class MixtureOrder {
public:
    // The round keys of source s's permutation for its pass e (derived by the caller).
    using KeySource = std::function<std::vector<uint64_t>(size_t source, uint64_t pass)>;

    // lengths and offsets: one per source (records, and where its indices start). size: the
    // positions of the epoch. Throws std::invalid_argument if they disagree with the tree.
    MixtureOrder(MixtureTree tree, std::vector<uint64_t> lengths, std::vector<uint64_t> offsets, uint64_t size,
                 KeySource keys);
    // The windowed order of source s's pass e (built by the caller, one per pass, used by this
    // order alone): each source read through windows of its shards.
    using WindowedSource = std::function<std::shared_ptr<WindowedOrder>(size_t source, uint64_t pass)>;
    MixtureOrder(MixtureTree tree, std::vector<uint64_t> lengths, std::vector<uint64_t> offsets, uint64_t size,
                 WindowedSource windows);

    uint64_t size() const noexcept { return size_; }

    // source[i] and local[i] (the record within the source) at each position; throws
    // std::out_of_range for a position >= size(). Safe to call from several threads.
    void pairs(const uint64_t* in, int64_t* source, int64_t* local, size_t count);
    // offset of the source + the record within it, at each position.
    void apply(const uint64_t* in, int64_t* out, size_t count);
    // apply() at positions (first + i * step) mod wrap, i < count (see feistel_strided).
    void strided(uint64_t first, uint64_t step, size_t count, uint64_t wrap, int64_t* out);

private:
    // A source's current pass and its permutation (draws [base, base + length) of the source).
    struct Pass {
        uint64_t base = 0;
        std::unique_ptr<Feistel> perm;
        std::shared_ptr<WindowedOrder> windowed;
    };
    uint64_t local(const MixtureTree::Draw& d);
    void check(const uint64_t* in, size_t count) const;
    // emit(i, source, record within it) for the draw at position(i), i < count, kLanes at a time.
    template <class Position, class Emit>
    void each(size_t count, Position&& position, Emit&& emit);

    MixtureTree tree_;
    std::vector<uint64_t> lengths_, offsets_;
    uint64_t size_;
    KeySource keys_;
    WindowedSource windows_;
    std::mutex mutex_;  // guards passes_ (callers may run without the GIL)
    std::vector<Pass> passes_;
};

}  // namespace smstore
