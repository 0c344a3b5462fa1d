// The records a batch reads: one Store, or the open shards of a sharded dataset under its ShardIndex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shard_index.hpp"
#include "store.hpp"

namespace smstore {

// An immutable view of records 0..size()-1: one blob, the shards of a dataset that were open when
// it was made, or several of those one after another. It holds each of its stores (so their
// mappings outlive a close() or a release of them elsewhere while a batch reads them) and, per
// shard, what a read needs: the offsets index, the data section and its size. A shard that was not
// open has no offsets: reading one of its records is an error (the caller opens every shard a
// batch reads before making the view).
class Records {
public:
    explicit Records(std::shared_ptr<const Store> store);
    // `shards`: one entry per shard of `index`, null where the shard is not open. `label` names
    // the dataset in errors.
    Records(std::shared_ptr<const ShardIndex> index, std::vector<std::shared_ptr<const Store>> shards,
            std::string label);
    // The records of `parts` one after another (a mixture's sources): their shards, in order, are
    // this view's shards, each kept as its part keeps it.
    Records(const std::vector<std::shared_ptr<const Records>>& parts, std::string label);
    // Shard k of `index` is records [firsts[k], firsts[k] + its size) of stores[k] (null where it
    // is not open): a block window's blocks, each the daemon's piece (first 0) or a run of records
    // of its shard's file. Throws std::invalid_argument where a run does not fit its store.
    Records(std::shared_ptr<const ShardIndex> index, std::vector<std::shared_ptr<const Store>> stores,
            const std::vector<uint64_t>& firsts, std::string label);

    uint64_t size() const noexcept { return size_; }
    const std::string& label() const noexcept { return label_; }
    bool sharded() const noexcept { return index_ != nullptr; }
    // Which shard holds a record: only when sharded().
    const ShardIndex& index() const noexcept { return *index_; }

    // (shard, index within it) of record i < size().
    std::pair<size_t, uint64_t> locate(uint64_t i) const noexcept {
        if (!index_) return {0, i};
        return index_->locate(i);
    }
    // The offsets index of shard k (null when it is not open) and its data section.
    const uint64_t* offsets(size_t k) const noexcept { return offsets_[k]; }
    const unsigned char* data(size_t k) const noexcept { return data_[k]; }
    uint64_t data_size(size_t k) const noexcept { return data_size_[k]; }
    // The store of shard k (null when it is not open), for its errors.
    const Store* shard(size_t k) const noexcept { return stores_[k].get(); }
    // The store of shard k, which must be open: throws Error otherwise.
    const Store& open_shard(size_t k, uint64_t i) const;

private:
    std::shared_ptr<const ShardIndex> index_;  // null for one blob
    std::vector<std::shared_ptr<const Store>> stores_;
    std::vector<const uint64_t*> offsets_;
    std::vector<const unsigned char*> data_;
    std::vector<uint64_t> data_size_;
    uint64_t size_ = 0;
    std::string label_;
};

}  // namespace smstore
