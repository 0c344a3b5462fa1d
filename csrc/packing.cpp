// The bin packer: one pass over the lengths with a small buffer of open bins, scanned linearly
// (it is a few dozen bins: a scan beats a tree, and keeps the ties' order plain).
#include "packing.hpp"

#include <stdexcept>

namespace smstore {

PackRule PackRule::parse(int64_t length, int64_t open_bins, const std::string& fit, const std::string& close) {
    if (length < 1) throw std::invalid_argument("length must be at least 1, not " + std::to_string(length));
    if (open_bins < 1) throw std::invalid_argument("open_bins must be at least 1, not " + std::to_string(open_bins));
    PackRule rule{length, static_cast<size_t>(open_bins), Fit::Best, Close::Fullest};
    if (fit == "first-fit") {
        rule.fit = Fit::First;
    } else if (fit != "best-fit") {
        throw std::invalid_argument("algorithm must be one of ('best-fit', 'first-fit'), not '" + fit + "'");
    }
    if (close == "oldest") {
        rule.close = Close::Oldest;
    } else if (close == "all") {
        rule.close = Close::All;
    } else if (close != "fullest") {
        throw std::invalid_argument("close must be one of ('fullest', 'oldest', 'all'), not '" + close + "'");
    }
    return rule;
}

namespace {

// The packer's state for one run: the open bins, oldest first. emit(bin, document, first, count)
// sees every piece placed; bins are numbered in the order they open.
class Packer {
public:
    explicit Packer(const PackRule& rule) : rule_(rule) { open_.reserve(rule.open_bins); }

    int64_t bins() const noexcept { return bins_; }

    template <class Emit>
    void add(int64_t document, int64_t tokens, Emit&& emit) {
        if (tokens < 0) {
            throw std::invalid_argument("document " + std::to_string(document) + " has a negative length (" +
                                        std::to_string(tokens) + ")");
        }
        const int64_t length = rule_.length;
        const int64_t whole = tokens / length;  // bins of their own (a no-op emit drops the loop)
        for (int64_t k = 0; k < whole; ++k)
            emit(bins_ + k, document, k * length, length);
        bins_ += whole;
        const int64_t first = whole * length, piece = tokens - first;
        if (piece == 0) return;
        size_t at = find(piece);
        if (at == open_.size()) {
            if (open_.size() == rule_.open_bins) close_one();
            open_.push_back({length, bins_++});
            at = open_.size() - 1;
        }
        open_[at].room -= piece;
        emit(open_[at].bin, document, first, piece);
    }

private:
    struct Open {
        int64_t room, bin;
    };

    // The open bin the piece goes into, or open_.size() when none has room.
    size_t find(int64_t piece) const noexcept {
        size_t best = open_.size();
        for (size_t i = 0; i < open_.size(); ++i) {
            if (open_[i].room < piece) continue;
            if (rule_.fit == PackRule::Fit::First) return i;
            if (best == open_.size() || open_[i].room < open_[best].room) best = i;
        }
        return best;
    }

    void close_one() {
        switch (rule_.close) {
            case PackRule::Close::All:
                open_.clear();
                return;
            case PackRule::Close::Oldest:
                open_.erase(open_.begin());
                return;
            case PackRule::Close::Fullest: {
                size_t fullest = 0;  // the oldest of the fullest
                for (size_t i = 1; i < open_.size(); ++i)
                    if (open_[i].room < open_[fullest].room) fullest = i;
                open_.erase(open_.begin() + static_cast<std::ptrdiff_t>(fullest));
                return;
            }
        }
    }

    PackRule rule_;
    std::vector<Open> open_;
    int64_t bins_ = 0;
};

}  // namespace

Packing pack_lengths(const int64_t* lengths, size_t count, const PackRule& rule) {
    // Pieces in the order placed, then a stable counting sort by bin: a bin's rows keep their order.
    struct Piece {
        int64_t bin, document, first, count;
    };
    std::vector<Piece> pieces;
    pieces.reserve(count);
    Packer packer(rule);
    for (size_t i = 0; i < count; ++i) {
        packer.add(static_cast<int64_t>(i), lengths[i],
                   [&](int64_t bin, int64_t doc, int64_t first, int64_t n) { pieces.push_back({bin, doc, first, n}); });
    }
    Packing out;
    const auto bins = static_cast<size_t>(packer.bins());
    out.starts.assign(bins + 1, 0);
    for (const Piece& p : pieces)
        ++out.starts[static_cast<size_t>(p.bin) + 1];
    for (size_t b = 0; b < bins; ++b)
        out.starts[b + 1] += out.starts[b];
    std::vector<int64_t> next(out.starts.begin(), out.starts.end() - 1);
    out.segments.resize(3 * pieces.size());
    for (const Piece& p : pieces) {
        int64_t* row = &out.segments[3 * static_cast<size_t>(next[static_cast<size_t>(p.bin)]++)];
        row[0] = p.document;
        row[1] = p.first;
        row[2] = p.count;
    }
    return out;
}

void count_bins(const int64_t* lengths, size_t count, size_t group, const PackRule& rule, int64_t* out) {
    if (group < 1) throw std::invalid_argument("group must be at least 1");
    for (size_t first = 0, g = 0; first < count; first += group, ++g) {
        const size_t stop = count - first < group ? count : first + group;
        Packer packer(rule);
        for (size_t i = first; i < stop; ++i)
            packer.add(static_cast<int64_t>(i), lengths[i], [](auto...) {});
        out[g] = packer.bins();
    }
}

}  // namespace smstore
