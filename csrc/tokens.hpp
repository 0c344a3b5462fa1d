// Token streams: documents of tokens concatenated (an end-of-document token after each, or none),
// read as windows of length + 1 tokens (Megatron GPTDataset's samples) through gathers of segments.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "records.hpp"

namespace smstore {

// `count` tokens of document (global record) `document` from its token `first`, then `fill`
// fill tokens (a window's end-of-document token; a packed bin's padding). A window, or a bin, is
// a run of these gathered back to back.
struct Segment {
    uint64_t document = 0;
    uint64_t first = 0;
    uint64_t count = 0;
    uint64_t fill = 0;
    uint64_t row = 0;  // a packed bin's row in its batch (windows: unused)
};

// One group of a shuffled document order (TokenWindows' seed=, smstore/read/tokens.py): parts of
// the shards (shard -1), or of documents [lo, hi) of a shard, visited in a keyed Feistel order.
struct ShuffleGroup {
    int64_t shard = -1;
    uint64_t lo = 0, hi = 0;
    std::vector<uint64_t> bounds;  // part p is [bounds[p], bounds[p + 1]), in stored order
    std::vector<uint64_t> order;   // the part at each shuffled position
    std::vector<uint64_t> ends;    // the tokens through each shuffled position
    // The shuffled position holding token t of the group's stream (ends.size() when t is past it).
    size_t position(uint64_t t) const noexcept;
};

// A document order per epoch: the tree of groups of TokenWindows (at most `group` parts a group).
struct DocumentShuffle {
    int64_t seed = 0;
    int64_t epoch = 0;
    uint64_t group = 1024;
};

// Makes g the group of parts of [lo, hi) of `shard` (-1: the shards, lo 0 and hi their count) in
// the epoch's order: the bounds of smstore.read.tokens.group_bounds, the order of
// FeistelPermutation(parts, group_key(seed, epoch, shard, lo, hi)), and the token spans of bound
// b at offsets[b] / item + per_doc * b (a shard's offsets index; the stream's token_starts with
// item 1 and per_doc 0 for the shards). TokenWindows' groups are made here too.
void make_group(ShuffleGroup& g, const DocumentShuffle& shuffle, int64_t shard, uint64_t lo, uint64_t hi,
                const uint64_t* offsets, uint64_t item, uint64_t per_doc);

// The stream of a dataset's documents, in stored order or shuffled: shard k's documents are records
// [record_starts[k], record_starts[k + 1]) and its tokens (eod included) stream positions
// [token_starts[k], token_starts[k + 1]) in stored order.
struct TokenStream {
    std::vector<uint64_t> token_starts;
    std::vector<uint64_t> record_starts;
    uint64_t item = 1;     // bytes of a stored token
    uint64_t length = 1;   // a window holds length + 1 tokens; window k starts at token k * length
    bool has_eod = false;  // an end-of-document token follows every document
    int64_t eod = 0;       // its value
    uint64_t windows() const noexcept;
    // The shard holding stream token t < token_starts.back() (never one without tokens), in
    // stored order.
    size_t shard_of(uint64_t t) const noexcept;

    // Documents shuffled per epoch: the order, the shards' group (computed once), and an id
    // for the groups each thread keeps (see stream_locate).
    std::optional<DocumentShuffle> shuffle;
    ShuffleGroup shards;
    uint64_t id = 0;
    // Shuffles the documents (TokenWindows(seed=, epoch=, group=)).
    void set_shuffle(const DocumentShuffle& order);
    // Calls f(k) for each shard (with tokens) that stream tokens [from, to] lie in, in stream order.
    template <typename F>
    void for_shards(uint64_t from, uint64_t to, F f) const {
        if (!shuffle) {
            for (size_t k = shard_of(from), last = shard_of(to); k <= last; ++k)
                f(k);
            return;
        }
        for (size_t j = shards.position(from), last = shards.position(to); j <= last && j < shards.order.size(); ++j) {
            if (shards.ends[j] != (j ? shards.ends[j - 1] : 0)) f(static_cast<size_t>(shards.order[j]));
        }
    }
};

// The one rule of where a stream position lies inside one shard: the last record j of the
// `records` whose first token is at or before t, i.e. offsets[j] / item + per_doc * j <= t (a
// binary search of the offsets index, O(log n) reads), and t's place in it (its eod is at the
// document's length). TokenWindows.locate calls this too.
struct DocumentAt {
    uint64_t record = 0;  // within the shard
    uint64_t offset = 0;
};
DocumentAt locate_in_shard(const uint64_t* offsets, uint64_t records, uint64_t item, uint64_t per_doc,
                           uint64_t t) noexcept;

// Stream position t -> (global document, offset), in the stream's order: stored, or shuffled by the
// descent of TokenWindows (each thread keeps the last group of each level it built, for the
// stream with this id). The shard holding t must be open in `records`. Throws Error when its
// offsets disagree with the stream's token counts (data other than the stream was built from).
struct StreamPosition {
    uint64_t document = 0;
    uint64_t offset = 0;
};
StreamPosition stream_locate(const Records& records, const TokenStream& stream, uint64_t t);

// Appends a packed bin's segments to `out`: `count` rows (document, first, count) of int64, each
// `stride` apart, as PackedBins.segments gives them (a document's eod, when `has_eod`, is its token
// at its length: a fill token here), checking every document it reads. Returns the bin's tokens.
// Throws Error.
uint64_t bin_segments(const Records& records, uint64_t item, bool has_eod, const int64_t* rows, size_t count,
                      size_t stride, std::vector<Segment>& out);

// Appends window `sample`'s segments (length + 1 tokens in all) to `out`, checking every document
// it reads (inside its shard's data, a whole number of tokens). Throws Error.
void window_segments(const Records& records, const TokenStream& stream, uint64_t sample, std::vector<Segment>& out);

}  // namespace smstore
