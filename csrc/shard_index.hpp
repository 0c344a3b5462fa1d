// The global index of a sharded dataset: which shard holds global record i, in a few instructions.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace smstore {

// Records 0..N-1 split into shards: shard k holds records [starts[k], starts[k+1]).
class ShardIndex {
public:
    // `starts`: shard_count() + 1 cumulative record counts, from 0, never decreasing, at most
    // 2^32 - 1 shards. Throws std::invalid_argument otherwise.
    explicit ShardIndex(std::vector<uint64_t> starts);

    uint64_t size() const noexcept { return size_; }
    size_t shard_count() const noexcept { return starts_.size() - 1; }
    const std::vector<uint64_t>& starts() const noexcept { return starts_; }
    uint64_t shard_size(size_t k) const noexcept { return starts_[k + 1] - starts_[k]; }

    // (shard, index within it) of global record i < size(); the shard is never an empty one. When
    // every shard but the last holds per_shard_ records (what ShardedWriter and pack -j write), a
    // multiply by a precomputed reciprocal finds the shard, with no table to load on the way to the
    // record's offsets. Otherwise a table maps each run of 2^shift_ records to the shard holding its
    // first record; with shards of similar sizes, that shard or the next holds i. Lopsided shards
    // fall back to a binary search.
    std::pair<size_t, uint64_t> locate(uint64_t i) const noexcept {
        if (per_shard_) {
            // reciprocal_ = floor((2^64 - 1) / per_shard_) undershoots i / per_shard_ by less than
            // 2, so the estimate is the quotient or one below it: one step corrects it.
            uint64_t k = static_cast<uint64_t>((static_cast<unsigned __int128>(i) * reciprocal_) >> 64);
            uint64_t j = i - k * per_shard_;
            if (j >= per_shard_) {
                ++k;
                j -= per_shard_;
            }
            return {static_cast<size_t>(k), j};
        }
        size_t k = bucket_shard_[i >> shift_];
        for (int step = 0; starts_[k + 1] <= i; ++k) {
            if (++step == 4) {
                auto it = std::upper_bound(starts_.begin() + static_cast<std::ptrdiff_t>(k) + 1, starts_.end(), i);
                k = static_cast<size_t>(it - starts_.begin() - 1);
                break;
            }
        }
        return {k, i - starts_[k]};
    }

private:
    std::vector<uint64_t> starts_;
    uint64_t size_ = 0;  // starts_.back(), one load nearer
    unsigned shift_ = 63;
    std::vector<uint32_t> bucket_shard_;  // see locate(); empty when per_shard_ is set
    uint64_t per_shard_ = 0;              // records of every shard but the last, if they all hold as many (else 0)
    uint64_t reciprocal_ = 0;             // floor((2^64 - 1) / per_shard_), see locate()
};

}  // namespace smstore
