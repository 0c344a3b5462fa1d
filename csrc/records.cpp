// Records: the per-shard tables a batch reads, built once per set of open shards.
#include "records.hpp"

#include <stdexcept>

#include "error.hpp"

namespace smstore {

Records::Records(std::shared_ptr<const Store> store)
    : stores_{std::move(store)},
      offsets_{stores_[0]->offsets()},
      data_{stores_[0]->data()},
      data_size_{stores_[0]->data_size()},
      size_(stores_[0]->size()),
      label_(stores_[0]->label()) {}

Records::Records(std::shared_ptr<const ShardIndex> index, std::vector<std::shared_ptr<const Store>> shards,
                 std::string label)
    : Records(index, std::move(shards), std::vector<uint64_t>(index->shard_count(), 0), std::move(label)) {
    for (size_t k = 0; k < stores_.size(); ++k) {
        if (stores_[k] && stores_[k]->size() != index_->shard_size(k)) {
            throw std::invalid_argument("a shard's record count differs");
        }
    }
}

Records::Records(std::shared_ptr<const ShardIndex> index, std::vector<std::shared_ptr<const Store>> stores,
                 const std::vector<uint64_t>& firsts, std::string label)
    : index_(std::move(index)), stores_(std::move(stores)), size_(index_->size()), label_(std::move(label)) {
    if (stores_.size() != index_->shard_count() || firsts.size() != stores_.size()) {
        throw std::invalid_argument("one store and first record per shard are needed");
    }
    offsets_.assign(stores_.size(), nullptr);
    data_.assign(stores_.size(), nullptr);
    data_size_.assign(stores_.size(), 0);
    for (size_t k = 0; k < stores_.size(); ++k) {
        const Store* s = stores_[k].get();
        if (!s) continue;
        if (firsts[k] > s->size() || s->size() - firsts[k] < index_->shard_size(k)) {
            throw std::invalid_argument("a run of records does not fit its store");
        }
        offsets_[k] = s->offsets() + firsts[k];
        data_[k] = s->data();
        data_size_[k] = s->data_size();
    }
}

namespace {

std::shared_ptr<const ShardIndex> concatenated(const std::vector<std::shared_ptr<const Records>>& parts) {
    std::vector<uint64_t> starts{0};
    for (const auto& part : parts) {
        const uint64_t base = starts.back();
        if (!part->sharded()) {
            starts.push_back(base + part->size());
            continue;
        }
        const std::vector<uint64_t>& own = part->index().starts();
        for (size_t k = 1; k < own.size(); ++k)
            starts.push_back(base + own[k]);
    }
    return std::make_shared<const ShardIndex>(std::move(starts));
}

}  // namespace

Records::Records(const std::vector<std::shared_ptr<const Records>>& parts, std::string label)
    : index_(concatenated(parts)), size_(index_->size()), label_(std::move(label)) {
    for (const auto& part : parts) {
        stores_.insert(stores_.end(), part->stores_.begin(), part->stores_.end());
        offsets_.insert(offsets_.end(), part->offsets_.begin(), part->offsets_.end());
        data_.insert(data_.end(), part->data_.begin(), part->data_.end());
        data_size_.insert(data_size_.end(), part->data_size_.begin(), part->data_size_.end());
    }
}

const Store& Records::open_shard(size_t k, uint64_t i) const {
    if (!stores_[k]) {
        throw Error(Error::Kind::Closed, label_ + ": record " + std::to_string(i) + " is in shard " +
                                             std::to_string(k) + ", which was not open when its batch was queued");
    }
    return *stores_[k];
}

}  // namespace smstore
