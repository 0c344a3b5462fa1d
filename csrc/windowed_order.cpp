// WindowedOrder: window by a cursor over the window starts, shard by a search within the window.
#include "windowed_order.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>

#include "strided.hpp"

namespace smstore {

void feistel_strided(const Feistel& perm, uint64_t first, uint64_t step, size_t count, uint64_t wrap, int64_t* out) {
    // The positions in runs, each run through Feistel::apply (which interleaves values).
    constexpr size_t kRun = 256;
    uint64_t positions[kRun];
    size_t start = 0;
    for_strided(first, step, count, wrap, perm.n(), [&](uint64_t p, size_t i) {
        positions[i - start] = p;
        if (i - start + 1 == kRun || i + 1 == count) {
            perm.apply(positions, out + start, i - start + 1);
            start = i + 1;
        }
    });
}

WindowedOrder::WindowedOrder(std::vector<uint64_t> window_starts, std::vector<uint64_t> seq_starts,
                             std::vector<uint64_t> record_starts, size_t window, KeySource keys)
    : window_starts_(std::move(window_starts)),
      seq_starts_(std::move(seq_starts)),
      record_starts_(std::move(record_starts)),
      window_(window),
      keys_(std::move(keys)) {
    auto sorted = [](const std::vector<uint64_t>& v) { return std::is_sorted(v.begin(), v.end()); };
    if (window_ == 0 || window_starts_.empty() || window_starts_.front() != 0 || seq_starts_.empty() ||
        seq_starts_.front() != 0 || record_starts_.size() + 1 != seq_starts_.size() ||
        seq_starts_.back() != window_starts_.back() || !sorted(window_starts_) || !sorted(seq_starts_)) {
        throw std::invalid_argument("a windowed order's tables disagree");
    }
    for (size_t j = 0; j + 1 < window_starts_.size(); ++j) {
        if (j * window_ >= seq_starts_.size() || window_starts_[j] != seq_starts_[j * window_]) {
            throw std::invalid_argument("a windowed order's windows do not start at shard starts");
        }
    }
}

size_t WindowedOrder::window_of(uint64_t p) const noexcept {
    auto it = std::upper_bound(window_starts_.begin(), window_starts_.end(), p);
    return static_cast<size_t>(it - window_starts_.begin()) - 1;
}

const Feistel& WindowedOrder::perm(size_t j) {
    auto it = perms_.find(j);
    if (it != perms_.end()) return it->second;
    if (perms_.size() >= kMaxPerms) {
        perms_.clear();
        cursor_perm_ = nullptr;
    }
    Feistel f(window_starts_[j + 1] - window_starts_[j], keys_(j));
    return perms_.emplace(j, std::move(f)).first->second;
}

int64_t WindowedOrder::image(uint64_t p, size_t j) {
    return image(p, j, perm(j));
}

int64_t WindowedOrder::image(uint64_t p, size_t j, const Feistel& f) const {
    uint64_t base = window_starts_[j];
    uint64_t seq = base + f(p - base);
    // The shard holding seq is one of window j's: its first shard is j * window_ in shard order.
    auto lo = seq_starts_.begin() + static_cast<std::ptrdiff_t>(j * window_);
    auto hi = seq_starts_.begin() + static_cast<std::ptrdiff_t>(std::min((j + 1) * window_, record_starts_.size()));
    auto q = static_cast<size_t>(std::upper_bound(lo, hi, seq) - seq_starts_.begin()) - 1;
    return static_cast<int64_t>(record_starts_[q] + (seq - seq_starts_[q]));
}

int64_t WindowedOrder::at(uint64_t p) {
    if (cursor_perm_ == nullptr || p < window_starts_[cursor_] || p >= window_starts_[cursor_ + 1]) {
        cursor_ = window_of(p);
        cursor_perm_ = &perm(cursor_);
    }
    return image(p, cursor_, *cursor_perm_);
}

void WindowedOrder::apply(const uint64_t* in, int64_t* out, size_t count) {
    for (size_t i = 0; i < count; ++i) {
        if (in[i] >= size()) {
            throw std::out_of_range("position " + std::to_string(in[i]) + " out of range for an order of " +
                                    std::to_string(size()));
        }
        out[i] = image(in[i], window_of(in[i]));
    }
}

void WindowedOrder::strided(uint64_t first, uint64_t step, size_t count, uint64_t wrap, int64_t* out) {
    // Strided positions rise (until they wrap): the window is searched for only when one is left.
    size_t j = window_count();
    for_strided(first, step, count, wrap, size(), [&](uint64_t p, size_t i) {
        if (j >= window_count() || p < window_starts_[j] || p >= window_starts_[j + 1]) j = window_of(p);
        out[i] = image(p, j);
    });
}

}  // namespace smstore
