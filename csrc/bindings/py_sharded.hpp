// The Python-facing ShardedStore: one global index over several blobs (the shards of a manifest).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "py_store.hpp"
#include "records.hpp"
#include "shard_index.hpp"

namespace smstore::bindings {

// Records 0..N-1 of a dataset split into shards: shard k holds records [starts[k], starts[k+1]).
// Shards are Store objects made on first use by a Python `opener(k)` (which decides between the
// daemon's copy and a file mapping and checks the shard is the one the manifest names), so
// opening a dataset of thousands of shards maps none of them.
class PyShardedStore {
public:
    PyShardedStore(std::vector<uint64_t> starts, pybind11::object opener, std::string label);

    uint64_t size() const noexcept { return index_->size(); }
    size_t shard_count() const noexcept { return cores_.size(); }
    const std::string& label() const noexcept { return label_; }
    bool closed() const noexcept { return closed_; }
    bool check_open() const;  // false with StoreClosedError set

    // (shard, index within it) of global record i < size(): the core's ShardIndex::locate().
    std::pair<size_t, uint64_t> locate(uint64_t i) const noexcept { return index_->locate(i); }
    // The open shard k (opening it through the opener on first use), or nullptr with an error set.
    PyStore* shard_core(size_t k);
    pybind11::object shard(size_t k);  // the Store object of shard k (opened on first use)
    bool is_open(size_t k) const noexcept { return index_of_[k] != nullptr; }

    // Record j of shard k, which must be open (is_open(k)): from a small array of
    // what a read needs, so a random read over thousands of shards touches no shard object.
    PyObject* open_record(size_t k, uint64_t j) {
        const uint64_t* offsets = index_of_[k];
        Line& line = lines_[k];
        line.last_use = ++tick_;
        if (tick_ >= next_sweep_ && !release_idle()) return nullptr;
        uint64_t begin = offsets[j], end = offsets[j + 1];
        if (!Store::span_inside(begin, end, line.data_size)) return cores_[k]->record(j);  // sets the error
        return record_view(arena_view_.ptr(), line.arena_at + begin, line.arena_at + end);
    }

    // What the C++ batcher reads for a batch of global records `indices` (each < size()): every
    // shard they lie in is opened first (through the opener: the daemon's copy or a file, checked
    // against the manifest), their reads are counted for auto_release (after its sweep, so that it
    // never releases a shard of these), and the open shards are returned as one immutable view
    // that keeps them mapped while the batch reads them, released here or not. The view is made
    // again only when a shard has opened or closed since the last one. Throws
    // py::error_already_set (the opener's error, or StoreClosedError).
    std::shared_ptr<const Records> records_for(const uint64_t* indices, size_t n);

    // Record i (i < size()) as a new reference, or nullptr with a Python error set.
    PyObject* record(uint64_t i);
    PyObject* getitem(PyObject* key);
    pybind11::list get_batch(pybind11::handle indices);
    pybind11::tuple gather(pybind11::handle indices);
    pybind11::list starts() const;
    size_t open_count() const noexcept { return open_count_; }
    // Unmaps shard k (its Store is closed; record views already handed out keep their mapping).
    // It opens again through the opener on its next read.
    void release_shard(size_t k);
    // With auto_release on, a shard that no read has touched for the last idle_limit() reads is
    // released: over a windowed order, the shards of past windows leave every process's memory on
    // their own. The limit is 12 reads per open shard (plus 64), so a shard of the current
    // window, read with probability 1/open per read, goes idle that long with odds below e^-12;
    // at worst it is opened again. Returns false with a Python error set if a release failed.
    bool release_idle();
    uint64_t idle_limit() const noexcept { return 12 * static_cast<uint64_t>(open_count_) + 64; }
    bool auto_release() const noexcept { return auto_release_; }
    void set_auto_release(bool on) noexcept {
        auto_release_ = on;
        next_sweep_ = on ? tick_ + idle_limit() / 2 : UINT64_MAX;
    }
    void close();
    std::string repr() const;

private:
    std::vector<uint64_t> normalize_all(pybind11::handle indices) const;

    std::shared_ptr<const ShardIndex> index_;  // which shard holds a global record (shared with Records)
    std::vector<pybind11::object> shards_;     // the Store objects opened so far (None until then)
    std::vector<PyStore*> cores_;              // their PyStores (alive while shards_ holds them)
    void rebuild_arena();

    // A random read over thousands of shards loads, before the record's offsets, only the index
    // pointer of its shard: 8 bytes a shard, so a thousand shards' stay in the L1 cache and the
    // offsets load (the cache miss of the read) starts a few cycles after the index is known.
    std::vector<const uint64_t*> index_of_;  // shard k's offsets index while it is open, else nullptr
    // The rest of what a read of shard k needs, off that path.
    struct alignas(32) Line {
        uint64_t arena_at = 0;  // where its data section starts in arena_view_
        uint64_t data_size = 0;
        uint64_t last_use = 0;  // tick_ of its latest read
    };
    std::vector<Line> lines_;
    void forget(size_t k) noexcept {  // shard k closed: what it mapped is gone
        index_of_[k] = nullptr;
        lines_[k].arena_at = 0;
        lines_[k].data_size = 0;
    }
    std::vector<std::shared_ptr<Store>> stores_;  // per open shard, taken when it opened
    std::shared_ptr<const Records> records_;      // records_for()'s view of them; null once one opens or closes
    // Every record view is a slice of one memoryview, over an exporter that holds every shard open
    // so far (its buffer spans from the lowest to the highest of their data sections; only the
    // slices handed out, each inside one shard's data, are ever read). One view for all shards
    // keeps a random read over thousands of shards as cheap as over one blob, and any record
    // view keeps its shard mapped. Opening a shard makes a new exporter; older views keep theirs.
    pybind11::object arena_view_;
    pybind11::object opener_;
    std::string label_;
    bool closed_ = false;
    uint64_t tick_ = 0;                 // reads so far
    uint64_t next_sweep_ = UINT64_MAX;  // tick_ at which release_idle() runs next
    size_t open_count_ = 0;
    bool auto_release_ = false;
};

// The exporter behind PyShardedStore's record views: the shards it keeps mapped and the span of
// memory its buffer covers.
struct ShardArena {
    std::vector<std::shared_ptr<Store>> shards;
    const unsigned char* base = nullptr;
    uint64_t size = 0;
};

// The PyShardedStore inside a Python ShardedStore object, or nullptr with a Python error set.
PyShardedStore* py_sharded_from(PyObject* obj);
// Whether obj is a ShardedStore (no error set either way).
bool is_sharded(PyObject* obj);

}  // namespace smstore::bindings
