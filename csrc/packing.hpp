// The bin packer of smstore.PackedBins: documents of given lengths packed, in their order, into
// bins of a fixed number of tokens through a bounded buffer of open bins.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace smstore {

struct PackRule {
    enum class Fit { Best, First };
    // When a piece fits no open bin and the buffer is full: close the fullest open bin, the
    // oldest, or every one (Grain's rule: the whole batch of rows is emitted).
    enum class Close { Fullest, Oldest, All };

    int64_t length;    // tokens a bin holds, >= 1
    size_t open_bins;  // bins open at once, >= 1
    Fit fit;
    Close close;

    // From the names smstore.read.packing uses ("best-fit" / "first-fit", "fullest" / "oldest" /
    // "all"); throws std::invalid_argument on a bad name, length or buffer size.
    static PackRule parse(int64_t length, int64_t open_bins, const std::string& fit, const std::string& close);
};

// A packing: rows (document, first, count) of int64, bin b's rows being those in
// [starts[b], starts[b + 1]); bins in the order they were opened.
struct Packing {
    std::vector<int64_t> segments;  // 3 per row
    std::vector<int64_t> starts;    // bins + 1
};

// Packs documents lengths[0..count) (positions in it are the rows' documents). A document longer
// than a bin gives whole bins of its first length-token pieces, its rest packed as a document.
// Throws std::invalid_argument for a negative length. O(count * open_bins) time,
// O(pieces + open_bins) memory.
Packing pack_lengths(const int64_t* lengths, size_t count, const PackRule& rule);

// The bins of each group of `group` consecutive documents packed on its own (the last group may
// be shorter): out[g] for g < ceil(count / group). Nothing but the open bins is held.
void count_bins(const int64_t* lengths, size_t count, size_t group, const PackRule& rule, int64_t* out);

}  // namespace smstore
