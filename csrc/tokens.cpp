// Token windows located from the offsets indexes alone and cut into segments: nothing built or stored.
#include "tokens.hpp"

#include <algorithm>
#include <atomic>
#include <string>

#include "error.hpp"
#include "feistel.hpp"
#include "store.hpp"

namespace smstore {

uint64_t TokenStream::windows() const noexcept {
    uint64_t tokens = token_starts.empty() ? 0 : token_starts.back();
    return tokens > 1 ? (tokens - 1) / length : 0;
}

size_t TokenStream::shard_of(uint64_t t) const noexcept {
    auto it = std::upper_bound(token_starts.begin(), token_starts.end(), t);
    return static_cast<size_t>(it - token_starts.begin()) - 1;
}

size_t ShuffleGroup::position(uint64_t t) const noexcept {
    return static_cast<size_t>(std::upper_bound(ends.begin(), ends.end(), t) - ends.begin());
}

void make_group(ShuffleGroup& g, const DocumentShuffle& shuffle, int64_t shard, uint64_t lo, uint64_t hi,
                const uint64_t* offsets, uint64_t item, uint64_t per_doc) {
    g.shard = shard;
    g.lo = lo;
    g.hi = hi;
    uint64_t parts = shard < 0 || hi - lo <= shuffle.group ? hi - lo : shuffle.group;
    g.bounds.resize(parts + 1);
    for (uint64_t p = 0; p <= parts; ++p)
        g.bounds[p] = parts == hi - lo ? lo + p : lo + p * (hi - lo) / parts;
    std::string key = "smstore-token-docs:" + std::to_string(shuffle.seed) + ":" + std::to_string(shuffle.epoch) + ":" +
                      std::to_string(shard) + ":" + std::to_string(lo) + ":" + std::to_string(hi);
    Feistel perm(parts, feistel_round_keys(key));
    g.order.resize(parts);
    g.ends.resize(parts);
    for (uint64_t i = 0; i < parts; ++i)
        g.order[i] = i;
    // In place: apply reads each lane of positions before it writes their images.
    perm.apply(g.order.data(), reinterpret_cast<int64_t*>(g.order.data()), parts);
    auto tokens_at = [offsets, item, per_doc](uint64_t b) { return offsets[b] / item + per_doc * b; };
    uint64_t end = 0;
    for (uint64_t i = 0; i < parts; ++i) {
        uint64_t p = g.order[i];
        end += tokens_at(g.bounds[p + 1]) - tokens_at(g.bounds[p]);
        g.ends[i] = end;
    }
}

namespace {

std::atomic<uint64_t> next_stream_id{1};

}  // namespace

void TokenStream::set_shuffle(const DocumentShuffle& order) {
    shuffle = order;
    id = next_stream_id.fetch_add(1);
    make_group(shards, order, -1, 0, token_starts.size() - 1, token_starts.data(), 1, 0);
}

DocumentAt locate_in_shard(const uint64_t* offsets, uint64_t records, uint64_t item, uint64_t per_doc,
                           uint64_t t) noexcept {
    uint64_t lo = 0, hi = records ? records - 1 : 0;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo + 1) / 2;
        if (offsets[mid] / item + per_doc * mid <= t) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return {lo, t - (offsets[lo] / item + per_doc * lo)};
}

namespace {

[[noreturn]] void stream_mismatch(const Records& records, uint64_t document, const std::string& what) {
    throw Error(Error::Kind::Format, records.label() + ": document " + std::to_string(document) + " " + what +
                                         "; the token windows or bins were made over other data (make them again)");
}

// Document d's token count, its record checked (inside its shard's data, whole `item`-byte tokens).
uint64_t document_tokens(const Records& records, uint64_t item, uint64_t d) {
    if (d >= records.size()) stream_mismatch(records, d, "is past the dataset's end");
    auto [s, j] = records.locate(d);
    const Store& shard = records.open_shard(s, d);
    uint64_t b = records.offsets(s)[j], e = records.offsets(s)[j + 1];
    if (!Store::span_inside(b, e, records.data_size(s))) throw shard.span_error(j, b, e);
    if ((e - b) % item) {
        throw Error(Error::Kind::Format, records.label() + ": record " + std::to_string(d) + " of " +
                                             std::to_string(e - b) + " bytes is not a whole number of " +
                                             std::to_string(item) +
                                             "-byte tokens; the blob was written wrongly, re-pack it");
    }
    return (e - b) / item;
}

}  // namespace

namespace {

// Shard k's offsets index, checked to lie inside its data.
const uint64_t* shard_offsets(const Records& records, const TokenStream& stream, size_t k) {
    uint64_t first = stream.record_starts[k], count = stream.record_starts[k + 1] - first;
    const uint64_t* offsets = records.offsets(k);
    if (!offsets) records.open_shard(k, first);  // throws: not open
    if (!Store::span_inside(0, offsets[count], records.data_size(k))) {
        stream_mismatch(records, first + count - 1, "ends past its shard's data");
    }
    return offsets;
}

// The groups this thread built last, one per level below the shards', for the stream `id`: the
// next window (and a window's next document) most often lies in the same ones.
struct GroupCache {
    uint64_t id = 0;
    std::vector<ShuffleGroup> levels;
};
thread_local GroupCache group_cache;

// The shuffled stream's descent: the shard holding t, then the part of each level's group down to
// a group of documents.
StreamPosition shuffled_locate(const Records& records, const TokenStream& stream, uint64_t t) {
    const DocumentShuffle& shuffle = *stream.shuffle;
    size_t j = stream.shards.position(t);
    size_t k = static_cast<size_t>(stream.shards.order[j]);
    t -= j ? stream.shards.ends[j - 1] : 0;
    const uint64_t* offsets = shard_offsets(records, stream, k);
    const uint64_t first = stream.record_starts[k], per_doc = stream.has_eod ? 1 : 0;
    GroupCache& cache = group_cache;
    if (cache.id != stream.id) cache = GroupCache{stream.id, {}};
    uint64_t lo = 0, hi = stream.record_starts[k + 1] - first;
    for (size_t level = 0;; ++level) {
        if (cache.levels.size() <= level) cache.levels.emplace_back();
        ShuffleGroup& g = cache.levels[level];
        if (g.shard != static_cast<int64_t>(k) || g.lo != lo || g.hi != hi || g.order.empty()) {
            make_group(g, shuffle, static_cast<int64_t>(k), lo, hi, offsets, stream.item, per_doc);
        }
        size_t at = g.position(t);
        if (at == g.ends.size()) stream_mismatch(records, first + hi - 1, "ends before the stream's token counts say");
        uint64_t part = g.order[at];
        t -= at ? g.ends[at - 1] : 0;
        if (hi - lo <= shuffle.group) return {first + lo + part, t};
        lo = g.bounds[part];
        hi = g.bounds[part + 1];
    }
}

}  // namespace

StreamPosition stream_locate(const Records& records, const TokenStream& stream, uint64_t t) {
    if (stream.shuffle) return shuffled_locate(records, stream, t);
    size_t k = stream.shard_of(t);
    uint64_t first = stream.record_starts[k], count = stream.record_starts[k + 1] - first;
    const uint64_t* offsets = shard_offsets(records, stream, k);
    DocumentAt at = locate_in_shard(offsets, count, stream.item, stream.has_eod ? 1 : 0, t - stream.token_starts[k]);
    return {first + at.record, at.offset};
}

void window_segments(const Records& records, const TokenStream& stream, uint64_t sample, std::vector<Segment>& out) {
    uint64_t t = sample * stream.length;
    StreamPosition p = stream_locate(records, stream, t);
    uint64_t left = stream.length + 1, doc = p.document, at = p.offset;
    while (left) {
        if (stream.shuffle && left < stream.length + 1) {  // the next document is the shuffled stream's
            p = stream_locate(records, stream, t);
            doc = p.document;
            at = p.offset;
        }
        uint64_t tokens = document_tokens(records, stream.item, doc);
        if (at > tokens || (at == tokens && !stream.has_eod && tokens)) {
            stream_mismatch(records, doc, "is shorter than the stream's token counts say");
        }
        Segment seg{doc, at, std::min(tokens - at, left), 0};
        left -= seg.count;
        if (left && stream.has_eod) {
            seg.fill = 1;
            --left;
        }
        out.push_back(seg);
        t += seg.count + seg.fill;
        ++doc;
        at = 0;
    }
}

uint64_t bin_segments(const Records& records, uint64_t item, bool has_eod, const int64_t* rows, size_t count,
                      size_t stride, std::vector<Segment>& out) {
    uint64_t total = 0;
    for (size_t m = 0; m < count; ++m, rows += stride) {
        if (rows[0] < 0 || rows[1] < 0 || rows[2] < 0) {
            throw Error(Error::Kind::Format, records.label() + ": a packed bin's segment (" + std::to_string(rows[0]) +
                                                 ", " + std::to_string(rows[1]) + ", " + std::to_string(rows[2]) +
                                                 ") is negative; make the bins again over this data");
        }
        auto doc = static_cast<uint64_t>(rows[0]), first = static_cast<uint64_t>(rows[1]);
        auto want = static_cast<uint64_t>(rows[2]);
        uint64_t tokens = document_tokens(records, item, doc);
        uint64_t ends = tokens + (has_eod ? 1 : 0);
        if (first > ends || want > ends - first)
            stream_mismatch(records, doc, "is shorter than a packed bin's segment");
        Segment seg{doc, first, std::min(want, tokens - std::min(first, tokens)), 0};
        seg.fill = want - seg.count;  // the eod
        out.push_back(seg);
        total += want;
    }
    return total;
}

}  // namespace smstore
