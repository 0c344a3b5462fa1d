// MixtureTree and MixtureOrder: the descent with one multiply per division, and each source's
// permutation kept for its current pass (a rank's positions rise, so a source's draws mostly do).
#include "mixture.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "strided.hpp"

namespace smstore {

namespace {
constexpr uint64_t kMaxShare = uint64_t{1} << 31;
constexpr uint64_t kMaxPosition = uint64_t{1} << 63;
}  // namespace

SmallDivisor::SmallDivisor(uint64_t d) : d_(d) {
    if (d < 2 || d > kMaxShare) throw std::invalid_argument("a mixture node's share must be in [2, 2**31]");
    unsigned l = 0;
    while ((uint64_t{1} << l) < d)
        ++l;
    shift_ = l - 1;
    magic_ = static_cast<uint64_t>(((static_cast<unsigned __int128>(1) << (63 + l)) + d - 1) / d);
}

MixtureTree::MixtureTree(const std::vector<uint64_t>& a, const std::vector<uint64_t>& q,
                         const std::vector<int64_t>& left, const std::vector<int64_t>& right, int64_t root,
                         size_t sources)
    : sources_(sources) {
    size_t count = q.size();
    if (a.size() != count || left.size() != count || right.size() != count) {
        throw std::invalid_argument("a mixture tree's arrays differ in length");
    }
    if (count + sources > UINT32_MAX) throw std::invalid_argument("a mixture tree of over 2**32 nodes");
    internal_ = static_cast<uint32_t>(count);
    // A child is a node built before its parent (no cycles) or a source that exists.
    auto index = [&](int64_t c, size_t parent) {
        bool ok = c >= 0 ? static_cast<uint64_t>(c) < parent : static_cast<uint64_t>(-(c + 1)) < sources;
        if (!ok) throw std::invalid_argument("a mixture tree's node refers to a child out of range");
        return static_cast<uint32_t>(c >= 0 ? c : static_cast<int64_t>(count) - (c + 1));
    };
    root_ = index(root, count);
    nodes_.reserve(count + sources);
    for (size_t j = 0; j < count; ++j) {
        if (a[j] == 0 || a[j] >= q[j] || q[j] > kMaxShare) {
            throw std::invalid_argument("mixture node " + std::to_string(j) + " needs 0 < a < q <= 2**31");
        }
        nodes_.push_back(Node{SmallDivisor(q[j]), a[j], (q[j] - 1) / 2, q[j] - a[j], q[j] * a[j], 0, index(left[j], j),
                              index(right[j], j)});
    }
    for (size_t s = 0; s < sources; ++s) {
        auto self = static_cast<uint32_t>(count + s);
        nodes_.push_back(Node{SmallDivisor(2), 1, 0, 1, 2, ~uint64_t{0}, self, self});
    }
}

void MixtureTree::locate_lanes(const uint64_t* in, Draw* out, size_t count) const noexcept {
    uint64_t m[kLanes];
    uint32_t node[kLanes];
    for (size_t i = 0; i < count; ++i) {
        m[i] = in[i];
        node[i] = root_;
    }
    for (bool inside = root_ < internal_; inside;) {
        inside = false;
        for (size_t i = 0; i < count; ++i) {
            const Node& n = nodes_[node[i]];
            uint64_t d = n.q.quotient(m[i]);
            uint64_t x = m[i] * n.a + n.h - d * n.qa;  // r a + h, exact: the true value is < 2^63
            uint64_t y = n.q.quotient(x);
            uint64_t before = d * n.a + y;
            uint64_t go_left = uint64_t{0} - static_cast<uint64_t>(x - y * n.q.divisor() >= n.left_from);
            uint64_t next = (before & go_left) | ((m[i] - before) & ~go_left);
            m[i] = (m[i] & n.keep) | (next & ~n.keep);
            node[i] = n.right ^ ((n.left ^ n.right) & static_cast<uint32_t>(go_left));
            inside |= node[i] < internal_;
        }
    }
    for (size_t i = 0; i < count; ++i)
        out[i] = Draw{node[i] - internal_, m[i]};
}

void MixtureTree::locate(const uint64_t* in, int64_t* source, int64_t* before, size_t count) const {
    for (size_t i = 0; i < count; ++i) {
        if (in[i] >= kMaxPosition) {
            throw std::out_of_range("position " + std::to_string(in[i]) + " is past 2**63 - 1");
        }
    }
    Draw draws[kLanes];
    for (size_t i = 0; i < count; i += kLanes) {
        size_t k = std::min(kLanes, count - i);
        locate_lanes(in + i, draws, k);
        for (size_t j = 0; j < k; ++j) {
            source[i + j] = static_cast<int64_t>(draws[j].source);
            before[i + j] = static_cast<int64_t>(draws[j].before);
        }
    }
}

MixtureOrder::MixtureOrder(MixtureTree tree, std::vector<uint64_t> lengths, std::vector<uint64_t> offsets,
                           uint64_t size, KeySource keys)
    : tree_(std::move(tree)),
      lengths_(std::move(lengths)),
      offsets_(std::move(offsets)),
      size_(size),
      keys_(std::move(keys)),
      passes_(tree_.sources()) {
    if (lengths_.size() != tree_.sources() || offsets_.size() != tree_.sources()) {
        throw std::invalid_argument("a mixture order needs one length and one offset per source");
    }
    if (size_ > kMaxPosition) throw std::invalid_argument("a mixture epoch holds at most 2**63 positions");
    for (size_t s = 0; s < lengths_.size(); ++s) {
        if (lengths_[s] == 0 || lengths_[s] > kMaxPosition || offsets_[s] > kMaxPosition - lengths_[s]) {
            throw std::invalid_argument("source " + std::to_string(s) +
                                        "'s records must be non-empty and end below 2**63");
        }
    }
}

MixtureOrder::MixtureOrder(MixtureTree tree, std::vector<uint64_t> lengths, std::vector<uint64_t> offsets,
                           uint64_t size, WindowedSource windows)
    : MixtureOrder(std::move(tree), std::move(lengths), std::move(offsets), size, KeySource()) {
    if (!windows) throw std::invalid_argument("a windowed mixture order needs its sources' windowed orders");
    windows_ = std::move(windows);
}

uint64_t MixtureOrder::local(const MixtureTree::Draw& d) {
    Pass& pass = passes_[d.source];
    uint64_t n = lengths_[d.source];
    uint64_t within = d.before - pass.base;  // wraps past n when before < base
    if (!(pass.perm || pass.windowed) || within >= n) {
        uint64_t e = d.before / n;
        pass.base = e * n;
        within = d.before - pass.base;
        if (windows_) {
            pass.windowed = windows_(d.source, e);
            if (!pass.windowed || pass.windowed->size() != n) {
                pass.windowed.reset();
                throw std::invalid_argument("source " + std::to_string(d.source) +
                                            "'s windowed order does not hold its records");
            }
        } else {
            pass.perm = std::make_unique<Feistel>(n, keys_(d.source, e));
        }
    }
    return pass.windowed ? static_cast<uint64_t>(pass.windowed->at(within)) : (*pass.perm)(within);
}

template <class Position, class Emit>
void MixtureOrder::each(size_t count, Position&& position, Emit&& emit) {
    std::lock_guard<std::mutex> lock(mutex_);
    uint64_t in[MixtureTree::kLanes];
    MixtureTree::Draw draws[MixtureTree::kLanes];
    for (size_t i = 0; i < count; i += MixtureTree::kLanes) {
        size_t k = std::min(MixtureTree::kLanes, count - i);
        for (size_t j = 0; j < k; ++j)
            in[j] = position(i + j);
        tree_.locate_lanes(in, draws, k);
        for (size_t j = 0; j < k; ++j)
            emit(i + j, draws[j].source, local(draws[j]));
    }
}

void MixtureOrder::check(const uint64_t* in, size_t count) const {
    for (size_t i = 0; i < count; ++i) {
        if (in[i] >= size_) {
            throw std::out_of_range("position " + std::to_string(in[i]) + " out of range for a mixture epoch of " +
                                    std::to_string(size_));
        }
    }
}

void MixtureOrder::pairs(const uint64_t* in, int64_t* source, int64_t* local_out, size_t count) {
    check(in, count);
    each(
        count, [&](size_t i) { return in[i]; },
        [&](size_t i, size_t s, uint64_t j) {
            source[i] = static_cast<int64_t>(s);
            local_out[i] = static_cast<int64_t>(j);
        });
}

void MixtureOrder::apply(const uint64_t* in, int64_t* out, size_t count) {
    check(in, count);
    each(
        count, [&](size_t i) { return in[i]; },
        [&](size_t i, size_t s, uint64_t j) { out[i] = static_cast<int64_t>(offsets_[s] + j); });
}

void MixtureOrder::strided(uint64_t first, uint64_t step, size_t count, uint64_t wrap, int64_t* out) {
    // for_strided checks the range and computes the positions; the lanes then take them in order.
    std::vector<uint64_t> positions(count);
    for_strided(first, step, count, wrap, size_, [&](uint64_t p, size_t i) { positions[i] = p; });
    apply(positions.data(), out, count);
}

}  // namespace smstore
