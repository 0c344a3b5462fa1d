// ShardIndex: the checks of a sharded dataset's prefix sums and the tables locate() reads.
#include "shard_index.hpp"

#include <stdexcept>

namespace smstore {

ShardIndex::ShardIndex(std::vector<uint64_t> starts) : starts_(std::move(starts)) {
    if (starts_.empty() || starts_.front() != 0) throw std::invalid_argument("starts must begin with 0");
    for (size_t k = 1; k < starts_.size(); ++k) {
        if (starts_[k] < starts_[k - 1]) throw std::invalid_argument("starts must not decrease");
    }
    if (starts_.size() - 1 > UINT32_MAX) throw std::invalid_argument("too many shards");
    size_ = starts_.back();
    // Shards of one size but the last (no larger than them): locate() divides, with no table.
    size_t count = starts_.size() - 1;
    uint64_t per = count ? starts_[1] : 0;
    bool uniform = per > 0 && starts_[count] - starts_[count - 1] <= per;
    for (size_t k = 1; uniform && k + 1 < count; ++k)
        uniform = starts_[k + 1] - starts_[k] == per;
    per_shard_ = uniform ? per : 0;
    if (uniform) {
        reciprocal_ = UINT64_MAX / per;
        return;
    }
    // About four buckets a shard: a bucket of 2^shift_ records, the smallest power of two that
    // keeps the table within 4 * shards + 1 entries.
    uint64_t n = size_, want = 4 * uint64_t{count} + 1;
    shift_ = 0;
    while (shift_ < 63 && (n >> shift_) >= want)
        ++shift_;
    bucket_shard_.resize(static_cast<size_t>((n >> shift_) + 1));
    size_t k = 0;
    for (size_t b = 0; b < bucket_shard_.size(); ++b) {
        uint64_t first = static_cast<uint64_t>(b) << shift_;
        while (k + 2 < starts_.size() && starts_[k + 1] <= first)
            ++k;
        bucket_shard_[b] = static_cast<uint32_t>(k);
    }
}

}  // namespace smstore
