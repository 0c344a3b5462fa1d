// Token windows located from the offsets indexes alone and cut into segments: nothing built or stored.
#include "tokens.hpp"

#include <algorithm>
#include <string>

#include "error.hpp"
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
                                         "; the token windows were made over other data (make them again)");
}

// Document d's token count, its record checked (inside its shard's data, whole tokens).
uint64_t document_tokens(const Records& records, const TokenStream& stream, uint64_t d) {
    if (d >= records.size()) stream_mismatch(records, d, "is past the dataset's end");
    auto [s, j] = records.locate(d);
    const Store& shard = records.open_shard(s, d);
    uint64_t b = records.offsets(s)[j], e = records.offsets(s)[j + 1];
    if (!Store::span_inside(b, e, records.data_size(s))) throw shard.span_error(j, b, e);
    if ((e - b) % stream.item) {
        throw Error(Error::Kind::Format, records.label() + ": record " + std::to_string(d) + " of " +
                                             std::to_string(e - b) + " bytes is not a whole number of " +
                                             std::to_string(stream.item) +
                                             "-byte tokens; the blob was written wrongly, re-pack it");
    }
    return (e - b) / stream.item;
}

}  // namespace

StreamPosition stream_locate(const Records& records, const TokenStream& stream, uint64_t t) {
    size_t k = stream.shard_of(t);
    uint64_t first = stream.record_starts[k], count = stream.record_starts[k + 1] - first;
    const uint64_t* offsets = records.offsets(k);
    if (!offsets) records.open_shard(k, first);  // throws: not open
    if (!Store::span_inside(0, offsets[count], records.data_size(k))) {
        stream_mismatch(records, first + count - 1, "ends past its shard's data");
    }
    DocumentAt at = locate_in_shard(offsets, count, stream.item, stream.has_eod ? 1 : 0, t - stream.token_starts[k]);
    return {first + at.record, at.offset};
}

void window_segments(const Records& records, const TokenStream& stream, uint64_t sample, std::vector<Segment>& out) {
    StreamPosition p = stream_locate(records, stream, sample * stream.length);
    uint64_t left = stream.length + 1, doc = p.document, at = p.offset;
    while (left) {
        uint64_t tokens = document_tokens(records, stream, doc);
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
        ++doc;
        at = 0;
    }
}

}  // namespace smstore
