// smstore._core.BatchSpec, collate_batch and Batcher: the bindings of batcher.hpp (TokenCollator and smstore.Loader).
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <iterator>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "batcher.hpp"
#include "error.hpp"
#include "py_sharded.hpp"
#include "py_store.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

// numpy's codes for the batcher's types, in Dtype's order: the one table between the two.
constexpr const char* kDtypeCodes[] = {"u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8", "f4", "f8"};

Dtype parse_dtype(const std::string& code) {
    for (size_t k = 0; k < std::size(kDtypeCodes); ++k) {
        if (code == kDtypeCodes[k]) return static_cast<Dtype>(k);
    }
    throw py::value_error("unsupported batch dtype " + code + " (u1 i1 u2 i2 u4 i4 u8 i8 f4 f8 are)");
}

bool is_float(Dtype d) {
    return d == Dtype::F32 || d == Dtype::F64;
}

// A Block seen from Python: a writable 1-D uint8 buffer that keeps the block alive (and so out of
// reuse: see Batcher) while any array over it lives.
struct BlockExport {
    std::shared_ptr<Block> block;
    uint64_t bytes;
};

// The numpy dtypes of a spec's outputs, made once (a Batcher hands out many batches).
struct BatchDtypes {
    explicit BatchDtypes(const CollateSpec& spec)
        : out(std::string("=") + kDtypeCodes[static_cast<int>(spec.out)]),
          i64(py::dtype::of<int64_t>()),
          i32(py::dtype::of<int32_t>()) {}
    py::dtype out, i64, i32;
};

// The batch as numpy arrays: (tokens over its block, then copies of lengths, cu_seqlens or None,
// indices or None).
py::tuple batch_arrays(const CollateSpec& spec, const ReadyBatch& ready, const BatchDtypes& dt) {
    const BatchLayout& l = ready.layout;
    py::object owner = py::cast(BlockExport{ready.block, l.bytes});
    unsigned char* base = ready.block->data();
    auto rows = static_cast<py::ssize_t>(l.rows), width = static_cast<py::ssize_t>(l.width);
    const py::dtype& out = dt.out;
    if (spec.bins) {  // tokens and position ids over the block, then copies of cu_seqlens and indices
        py::array tokens(out, {rows, width}, {}, base + l.tokens_at, owner);
        py::array positions(dt.i64, {rows, width}, {}, base + l.lengths_at, owner);
        py::array cu(dt.i32, {static_cast<py::ssize_t>(l.cu_count)}, {}, base + l.cu_at);
        py::object indices = py::none();
        if (spec.with_indices) indices = py::array(dt.i64, {rows}, {}, base + l.indices_at);
        return py::make_tuple(std::move(tokens), std::move(positions), std::move(cu), std::move(indices));
    }
    py::array tokens;
    if (spec.pack) {
        tokens = py::array(out, {width}, {}, base + l.tokens_at, owner);
    } else {
        tokens = py::array(out, {rows, width}, {}, base + l.tokens_at, owner);
    }
    // The small outputs are copies (no base: pybind11 copies the data), so that keeping them (the
    // lengths, for logging) does not keep the whole block out of the ring's reuse.
    py::array lengths(dt.i64, {rows}, {}, base + l.lengths_at);
    py::object cu = py::none(), indices = py::none();
    if (spec.pack) cu = py::array(l.cu_int64 ? dt.i64 : dt.i32, {rows + 1}, {}, base + l.cu_at);
    if (spec.with_indices) indices = py::array(dt.i64, {rows}, {}, base + l.indices_at);
    return py::make_tuple(std::move(tokens), std::move(lengths), std::move(cu), std::move(indices));
}

// What a batch of `store` (a Store or a ShardedStore) at `indices` (each < its size) reads. A
// ShardedStore opens the shards they lie in first, running Python code (its opener).
std::shared_ptr<const Records> records_of(py::handle store, const std::vector<uint64_t>& indices) {
    if (is_sharded(store.ptr())) {
        PyShardedStore* s = py_sharded_from(store.ptr());
        if (!s) throw py::error_already_set();
        return s->records_for(indices.data(), indices.size());
    }
    PyStore* s = py_store_from(store.ptr());
    if (!s) throw py::error_already_set();
    return std::make_shared<const Records>(s->shared());
}

// The record count and label of a Store or a ShardedStore.
std::pair<uint64_t, std::string> size_and_label(py::handle store) {
    if (is_sharded(store.ptr())) {
        PyShardedStore* s = py_sharded_from(store.ptr());
        if (!s || !s->check_open()) throw py::error_already_set();
        return {s->size(), s->label()};
    }
    PyStore* s = py_store_from(store.ptr());
    if (!s) throw py::error_already_set();
    const Store& core = s->core();
    return {core.size(), core.label()};
}

// A mixture's sources (each a Store or a ShardedStore) read as one run of records: source s holds
// the mixture's global records [starts[s], starts[s + 1]), as MixtureDataset.locate splits them.
class MixtureSources {
public:
    explicit MixtureSources(py::handle sources) {
        std::string names;
        for (py::handle source : sources) {
            auto [count, label] = size_and_label(source);
            sources_.push_back(py::reinterpret_borrow<py::object>(source));
            starts_.push_back(starts_.back() + count);
            parts_.push_back(is_sharded(source.ptr()) ? nullptr : records_of(source, {}));
            names += (names.empty() ? "" : ", ") + label;
        }
        if (sources_.empty()) throw py::value_error("a mixture needs at least one source");
        label_ = "a mixture of " + std::to_string(sources_.size()) + " sources (" + names + ")";
    }
    uint64_t size() const noexcept { return starts_.back(); }
    const std::string& label() const noexcept { return label_; }

    // What batches of the global records `indices` (each < size()) read: every source's records
    // (a sharded one's after opening the shards these lie in), as one view, made again only when
    // a source's own view changed.
    std::shared_ptr<const Records> records_for(const std::vector<uint64_t>& indices) {
        std::vector<std::vector<uint64_t>> local(sources_.size());
        for (uint64_t i : indices) {
            auto s = static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), i) - starts_.begin()) - 1;
            local[s].push_back(i - starts_[s]);
        }
        bool changed = !view_;
        for (size_t s = 0; s < sources_.size(); ++s) {
            if (!is_sharded(sources_[s].ptr())) continue;                             // a blob's view never changes
            std::shared_ptr<const Records> part = records_of(sources_[s], local[s]);  // may run Python code
            changed = changed || part != parts_[s];
            parts_[s] = std::move(part);
        }
        if (changed) view_ = std::make_shared<const Records>(parts_, label_);
        return view_;
    }

private:
    std::vector<py::object> sources_;
    std::vector<uint64_t> starts_{0};
    std::vector<std::shared_ptr<const Records>> parts_;  // each source's view as of the last batch
    std::shared_ptr<const Records> view_;                // theirs, one after another
    std::string label_;
};

// A block window's reader (smstore.wire.blocks.BlockReader): its blocks are the shards of a view,
// each opened through the reader (the daemon's piece, else a run of its shard's file) before
// the batches that read it are queued, so the Loader reads what a DataLoader worker would.
class BlockSource {
public:
    explicit BlockSource(py::handle reader)
        : reader_(py::reinterpret_borrow<py::object>(reader)),
          index_(std::make_shared<const ShardIndex>(reader.attr("block_starts")().cast<std::vector<uint64_t>>())),
          label_(py::str(reader.attr("path")).cast<std::string>()) {}
    uint64_t size() const noexcept { return index_->size(); }
    const std::string& label() const noexcept { return label_; }

    // What batches of `indices` (each < size()) read: the blocks they lie in, each as the reader
    // gives it now, in a view of those alone (the reader detaches the pieces it moved past, and a
    // view must not keep them mapped for long). The last view is used again while every block
    // read is in it as the reader gives it (a view is O(blocks) to make).
    std::shared_ptr<const Records> records_for(const std::vector<uint64_t>& indices) {
        std::vector<std::shared_ptr<const Store>> stores(index_->shard_count());
        std::vector<uint64_t> firsts(index_->shard_count(), 0);
        py::object block_store = reader_.attr("block_store");
        bool same = view_ != nullptr;
        for (uint64_t i : indices) {
            size_t b = index_->locate(i).first;
            if (stores[b]) continue;
            py::tuple got = block_store(b);  // may run Python code (a wait for the daemon)
            PyStore* store = py_store_from(got[0].ptr());
            if (!store) throw py::error_already_set();
            stores[b] = store->shared();
            firsts[b] = got[1].cast<uint64_t>();
            same = same && view_->shard(b) == stores[b].get() && view_->offsets(b) == stores[b]->offsets() + firsts[b];
        }
        if (!same) view_ = std::make_shared<const Records>(index_, std::move(stores), firsts, label_);
        return view_;
    }

private:
    py::object reader_;
    std::shared_ptr<const ShardIndex> index_;  // one "shard" per block
    std::shared_ptr<const Records> view_;      // the last view made
    std::string label_;
};

py::tuple collate_batch(const CollateSpec& spec, py::handle store, py::handle indices, bool pinned) {
    if (spec.windows || spec.bins) {
        throw py::value_error("collate_batch batches records: token windows and bins go through a Batcher");
    }
    std::vector<uint64_t> idx = normalize_indices(indices, size_and_label(store).first);  // may run Python code
    std::shared_ptr<const Records> keep = records_of(store, idx);
    ReadyBatch ready;
    {
        py::gil_scoped_release release;
        std::vector<Segment> none;
        ready.layout = plan_batch(*keep, spec, idx.data(), idx.size(), none);
        ready.block = std::make_shared<Block>(ready.layout.bytes, pinned);
        fill_batch(*keep, spec, idx.data(), idx.size(), ready.layout, none, ready.block->data());
    }
    return batch_arrays(spec, ready, BatchDtypes(spec));
}

// What Python holds: the Batcher, the store it reads and the record count its indices are checked
// against. A Store's records are one view made here; a ShardedStore makes one per submit (after
// opening the shards the submitted batches read).
class PyBatcher {
public:
    PyBatcher(py::handle store, const CollateSpec& spec, size_t threads, size_t depth, bool pinned)
        : spec_(spec), store_(py::reinterpret_borrow<py::object>(store)) {
        if ((spec.windows || spec.bins) && (py::hasattr(store, "block_store") || py::isinstance<py::list>(store))) {
            throw py::value_error("token windows and bins read one store, not a block reader or a mixture's sources");
        }
        if (py::hasattr(store, "block_store")) {
            blocks_.emplace(store);
            count_ = blocks_->size();
            label_ = blocks_->label();
        } else if (py::isinstance<py::list>(store)) {
            mixture_.emplace(store);
            count_ = mixture_->size();
            label_ = mixture_->label();
        } else {
            std::tie(count_, label_) = size_and_label(store);
            if (spec.windows) count_ = checked_stream(store, *spec.windows, count_, label_);
            if (!is_sharded(store.ptr())) records_ = records_of(store, {});
        }
        batcher_ = std::make_shared<Batcher>(label_, spec, threads, depth, pinned);
    }

    // Draws up to max_batches batches of batch_size indices from `iterator` and queues them.
    // Returns (batches queued, whether the iterator is exhausted). A short last batch is queued
    // unless drop_last.
    py::tuple submit_from(py::handle iterator, uint64_t batch_size, uint64_t max_batches, bool drop_last) {
        core();  // closed: say so before drawing from the sampler
        if (batch_size == 0) throw py::value_error("batch_size must be >= 1");
        std::vector<uint64_t> indices;
        indices.reserve(batch_size * max_batches);
        bool exhausted = false;
        // Our samplers' iterators are generators that `yield from` a list of indices per chunk:
        // resuming the generator per index costs more than the rest of the batch's work on this
        // thread. `yield from` hands the list iterator's items on unchanged, so take them from it
        // directly (the generator, suspended at its `yield from`, sees its list run out and moves
        // on when next resumed: the same items in the same order, its bookkeeping intact).
        py::object inner;
        const uint64_t want = batch_size * max_batches;
        while (indices.size() < want) {
            if (inner) take_from_list_iterator(inner, want, indices);
            if (indices.size() >= want) break;
            PyObject* item = inner ? PyIter_Next(inner.ptr()) : nullptr;
            if (!item) {
                if (PyErr_Occurred()) throw py::error_already_set();
                inner = py::object();
                item = PyIter_Next(iterator.ptr());
                if (item && PyGen_Check(iterator.ptr())) {
                    PyObject* sub = PyObject_GetAttrString(iterator.ptr(), "gi_yieldfrom");
                    if (!sub) throw py::error_already_set();
                    if (Py_TYPE(sub) == &PyListIter_Type) inner = py::reinterpret_borrow<py::object>(sub);
                    Py_DECREF(sub);
                }
            }
            if (!item) {
                if (PyErr_Occurred()) throw py::error_already_set();
                exhausted = true;
                break;
            }
            Py_ssize_t value;
            bool ok = index_value(item, &value);
            Py_DECREF(item);
            if (!ok) throw py::error_already_set();
            check_index(value);
            indices.push_back(static_cast<uint64_t>(value));
        }
        uint64_t full = indices.size() / batch_size, rest = indices.size() % batch_size;
        std::vector<uint64_t> sizes(full, batch_size);
        if (rest && !drop_last) sizes.push_back(rest);
        if (!rest || drop_last) indices.resize(full * batch_size);
        std::shared_ptr<const Records> records = records_for(indices);  // may run Python code
        // Taken only now: the sampler's code above may have closed the loader (close() frees the
        // Batcher this object holds; a reference taken before would dangle).
        core().submit(std::move(records), indices.data(), sizes.data(), sizes.size());
        return py::make_tuple(sizes.size(), exhausted);
    }

    // Queues the batches of `indices` (an int64 array: a chunk our samplers computed, no Python int
    // per index): full batches of batch_size, then the rest as a short batch unless drop_last.
    // Returns the batches queued.
    uint64_t submit_array(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& indices,
                          uint64_t batch_size, bool drop_last) {
        core();  // closed: say so before anything else
        if (batch_size == 0) throw py::value_error("batch_size must be >= 1");
        if (indices.ndim() != 1) throw py::value_error("indices must be a 1-D array");
        auto n = static_cast<size_t>(indices.size());
        const int64_t* in = indices.data();
        for (size_t i = 0; i < n; ++i)
            check_index(static_cast<Py_ssize_t>(in[i]));
        uint64_t full = n / batch_size, rest = n % batch_size;
        std::vector<uint64_t> sizes(full, batch_size);
        if (rest && !drop_last) sizes.push_back(rest);
        std::vector<uint64_t> queued(in, in + (rest && !drop_last ? n : full * batch_size));  // all >= 0
        std::shared_ptr<const Records> records = records_for(queued);  // may run Python code (see submit_from)
        core().submit(std::move(records), queued.data(), sizes.data(), sizes.size());
        return sizes.size();
    }

    // Queues one batch of packed bins: their indices (for the batch's "indices") and their
    // segments, rows (row in the batch, document, first, count) in order (PackedBins.collate's).
    void submit_bins(const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& indices,
                     const py::array_t<int64_t, py::array::c_style | py::array::forcecast>& rows) {
        core();
        if (!spec_.bins) throw py::value_error("submit_bins needs a spec of packed bins");
        if (indices.ndim() != 1 || rows.ndim() != 2 || rows.shape(1) != 4) {
            throw py::value_error("indices must be 1-D and rows an [n, 4] array of (row, document, first, count)");
        }
        const int64_t* r = rows.data();
        auto count = static_cast<size_t>(rows.shape(0));
        std::vector<uint64_t> documents;
        documents.reserve(count);
        for (size_t m = 0; m < count; ++m) {
            check_index(static_cast<Py_ssize_t>(r[4 * m + 1]));  // a document of the store
            documents.push_back(static_cast<uint64_t>(r[4 * m + 1]));
        }
        std::sort(documents.begin(), documents.end());
        documents.erase(std::unique(documents.begin(), documents.end()), documents.end());
        std::shared_ptr<const Records> records = records_ ? records_ : records_of(store_, documents);
        std::vector<uint64_t> ids;
        ids.reserve(static_cast<size_t>(indices.size()));
        for (py::ssize_t i = 0; i < indices.size(); ++i) {
            if (indices.data()[i] < 0) throw py::value_error("bin indices are >= 0");
            ids.push_back(static_cast<uint64_t>(indices.data()[i]));
        }
        core().submit_bins(std::move(records), std::move(ids), std::vector<int64_t>(r, r + 4 * count));
    }

    py::tuple next() {
        // Our own reference: another Python thread may close the loader while this one waits
        // without the GIL; the Batcher then stops (next() throws Closed) but lives until we return.
        std::shared_ptr<Batcher> b = batcher_;
        if (!b) core();  // throws Closed
        ReadyBatch ready;
        {
            py::gil_scoped_release release;
            ready = b->next();
        }
        return batch_arrays(spec_, ready, dtypes_);
    }

    uint64_t pending() { return core().pending(); }
    size_t threads() { return core().threads(); }
    size_t depth() { return core().depth(); }

    ~PyBatcher() { close(); }
    PyBatcher(const PyBatcher&) = delete;
    PyBatcher& operator=(const PyBatcher&) = delete;

    void close() {
        if (!batcher_) return;
        std::shared_ptr<Batcher> b = std::move(batcher_);
        if (b->forked()) {
            // Its threads and perhaps a lock they held stayed in the parent: destroying it would
            // wait for them forever. Leak it (the child's copy of the ring is the parent's pages).
            (void)new std::shared_ptr<Batcher>(std::move(b));  // never freed, on purpose
            return;
        }
        py::gil_scoped_release release;  // a thread may be mid-batch
        b->close();  // stops and joins the threads; a next() waiting in another thread throws Closed
        b.reset();   // freed here, or by that next() when it returns
    }

private:
    // Takes, in bulk, the items of the list that the list iterator `inner` has not yet given (up
    // to `want` indices in all), and moves the iterator past them, as PyIter_Next would one by one
    // (each item an index checked against the store). Stops at an item that is not an exact int
    // (its __index__ may run Python code): the caller takes that one through PyIter_Next.
    void take_from_list_iterator(py::handle inner, uint64_t want, std::vector<uint64_t>& indices) {
        // list_iterator.__reduce__() is (iter, (the list,), position) while items remain.
        py::tuple state = inner.attr("__reduce__")();
        if (state.size() < 3) return;  // exhausted: (iter, ([],))
        py::object seq = py::tuple(state[1])[0];
        if (!PyList_CheckExact(seq.ptr())) return;
        auto at = state[2].cast<Py_ssize_t>();
        Py_ssize_t end = PyList_GET_SIZE(seq.ptr()), start = at;
        while (at < end && indices.size() < want) {
            PyObject* item = PyList_GET_ITEM(seq.ptr(), at);
            if (!PyLong_CheckExact(item)) break;
            Py_ssize_t value = PyLong_AsSsize_t(item);
            if (value == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                break;  // beyond Py_ssize_t: PyIter_Next's path reports it
            }
            check_index(value);
            indices.push_back(static_cast<uint64_t>(value));
            ++at;
        }
        if (at != start) inner.attr("__setstate__")(at);
    }

    // What batches of `indices` read: for a ShardedStore, after opening the shards they lie in.
    std::shared_ptr<const Records> records_for(const std::vector<uint64_t>& indices) {
        if (records_) return records_;
        if (mixture_) return mixture_->records_for(indices);
        if (blocks_) return blocks_->records_for(indices);
        if (!spec_.windows) return records_of(store_, indices);
        // Token windows: the first document of every shard a window's tokens lie in (a window
        // may cross from one shard into the next ones).
        const TokenStream& stream = *spec_.windows;
        std::vector<uint64_t> documents;
        for (uint64_t w : indices) {
            stream.for_shards(w * stream.length, w * stream.length + stream.length,
                              [&](size_t k) { documents.push_back(stream.record_starts[k]); });
        }
        std::sort(documents.begin(), documents.end());
        documents.erase(std::unique(documents.begin(), documents.end()), documents.end());
        return records_of(store_, documents);
    }

    // The windows of `stream` over `store` (`records` records), checked against the store.
    static uint64_t checked_stream(py::handle store, const TokenStream& stream, uint64_t records,
                                   const std::string& label) {
        size_t shards = is_sharded(store.ptr()) ? py_sharded_from(store.ptr())->shard_count() : 1;
        if (stream.record_starts.size() != shards + 1 || stream.record_starts.back() != records) {
            throw Error(Error::Kind::Format, label + ": the token windows were made over " +
                                                 std::to_string(stream.record_starts.back()) + " records in " +
                                                 std::to_string(stream.record_starts.size() - 1) +
                                                 " shards, this store has " + std::to_string(records) + " in " +
                                                 std::to_string(shards) + ": make them again over it");
        }
        return stream.windows();
    }

    void check_index(Py_ssize_t value) const {
        if (value < 0 || static_cast<uint64_t>(value) >= count_) {
            throw Error(Error::Kind::Index, label_ + ": the sampler gave record index " + std::to_string(value) +
                                                ", out of range for " + std::to_string(count_) +
                                                " records (is it a sampler of another dataset?)");
        }
    }

    Batcher& core() {
        if (!batcher_) throw Error(Error::Kind::Closed, label_ + ": this loader is closed");
        return *batcher_;
    }
    CollateSpec spec_;
    py::object store_;
    std::shared_ptr<const Records> records_;  // a Store's (one view for every batch); null for a ShardedStore
    std::optional<MixtureSources> mixture_;   // a list of stores: a mixture's sources
    std::optional<BlockSource> blocks_;       // a block window's reader
    BatchDtypes dtypes_{spec_};
    uint64_t count_ = 0;
    std::string label_;
    std::shared_ptr<Batcher> batcher_;
};

}  // namespace

void register_loader(py::module_& m) {
    py::class_<BlockExport>(m, "_BatchBuffer", py::buffer_protocol()).def_buffer([](BlockExport& e) {
        return py::buffer_info(e.block->data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(e.bytes)}, {static_cast<py::ssize_t>(1)},
                               /*readonly=*/false);
    });

    py::class_<CollateSpec>(m, "BatchSpec")
        .def(py::init([](bool pack, const std::string& in_dtype, const std::string& out_dtype, int64_t pad_value,
                         std::optional<uint64_t> max_length, bool truncate_left, bool pad_left, bool fixed_length,
                         uint64_t multiple, bool with_indices) {
                 CollateSpec s;
                 s.pack = pack;
                 s.in = parse_dtype(in_dtype);
                 s.out = parse_dtype(out_dtype);
                 if (is_float(s.in) && !is_float(s.out)) {
                     throw py::value_error("float records cannot be batched as integers");
                 }
                 s.pad_value = pad_value;
                 s.max_length = max_length.value_or(UINT64_MAX);
                 s.truncate_left = truncate_left;
                 s.pad_left = pad_left;
                 s.fixed_length = fixed_length;
                 if (fixed_length && !max_length) throw py::value_error("fixed_length needs max_length");
                 s.multiple = multiple ? multiple : 1;
                 s.with_indices = with_indices;
                 return s;
             }),
             py::kw_only(), py::arg("pack"), py::arg("in_dtype"), py::arg("out_dtype"), py::arg("pad_value") = 0,
             py::arg("max_length") = py::none(), py::arg("truncate_left") = false, py::arg("pad_left") = false,
             py::arg("fixed_length") = false, py::arg("multiple") = 1, py::arg("with_indices") = false)
        .def_static(
            "windows",
            [](const std::string& in_dtype, const std::string& out_dtype, uint64_t length, std::optional<int64_t> eod,
               std::vector<uint64_t> token_starts, std::vector<uint64_t> record_starts, std::optional<int64_t> seed,
               int64_t epoch, uint64_t group) {
                CollateSpec s;
                s.in = parse_dtype(in_dtype);
                s.out = parse_dtype(out_dtype);
                if (is_float(s.in) || is_float(s.out)) throw py::value_error("token windows are integers");
                if (length == 0) throw py::value_error("length must be >= 1");
                bool sorted = std::is_sorted(token_starts.begin(), token_starts.end()) &&
                              std::is_sorted(record_starts.begin(), record_starts.end());
                if (token_starts.size() < 2 || token_starts.size() != record_starts.size() || !sorted ||
                    token_starts[0] != 0 || record_starts[0] != 0) {
                    throw py::value_error(
                        "token_starts and record_starts: one entry per shard and one more, from 0, "
                        "never decreasing");
                }
                auto stream = std::make_shared<TokenStream>();
                stream->token_starts = std::move(token_starts);
                stream->record_starts = std::move(record_starts);
                stream->item = dtype_size(s.in);
                stream->length = length;
                stream->has_eod = eod.has_value();
                stream->eod = eod.value_or(0);
                if (seed) {
                    if (group < 2) throw py::value_error("group must be >= 2");
                    stream->set_shuffle(DocumentShuffle{*seed, epoch, group});
                }
                s.windows = std::move(stream);
                s.with_indices = true;
                return s;
            },
            py::kw_only(), py::arg("in_dtype"), py::arg("out_dtype"), py::arg("length"), py::arg("eod"),
            py::arg("token_starts"), py::arg("record_starts"), py::arg("seed") = py::none(), py::arg("epoch") = 0,
            py::arg("group") = 1024,
            "Token windows of `length` + 1 tokens over a stream of documents (TokenWindows): per shard, the "
            "stream positions and records it starts at, and one more entry for the end; with a seed, the "
            "documents in epoch `epoch`'s shuffled order (groups of at most `group` parts).")
        .def_static(
            "bins",
            [](const std::string& in_dtype, const std::string& out_dtype, uint64_t length, std::optional<int64_t> eod,
               int64_t pad) {
                CollateSpec s;
                s.in = parse_dtype(in_dtype);
                s.out = parse_dtype(out_dtype);
                if (is_float(s.in) || is_float(s.out)) throw py::value_error("packed bins are integer tokens");
                if (length == 0) throw py::value_error("length must be >= 1");
                s.bins = true;
                s.bin_length = length;
                s.has_eod = eod.has_value();
                s.eod = eod.value_or(0);
                s.pad_value = pad;
                s.with_indices = true;
                return s;
            },
            py::kw_only(), py::arg("in_dtype"), py::arg("out_dtype"), py::arg("length"), py::arg("eod"), py::arg("pad"),
            "Packed bins of `length` tokens (PackedBins): each batch's bins gathered from their segments "
            "(submit_bins), "
            "`pad` after each bin's tokens, with position ids and cu_seqlens as PackedBins.collate makes them.");

    m.def(
        "shuffle_group",
        [](const py::array_t<uint64_t, py::array::c_style>& offsets, uint64_t item, uint64_t per_doc, int64_t seed,
           int64_t epoch, int64_t shard, uint64_t lo, uint64_t hi, uint64_t group) {
            if (offsets.ndim() != 1 || item == 0 || group < 2 || lo >= hi ||
                hi >= static_cast<uint64_t>(offsets.size()) || (shard < 0 && lo != 0)) {
                throw py::value_error("shuffle_group: offsets (1-D) past hi, item >= 1, group >= 2, lo < hi");
            }
            ShuffleGroup g;
            {
                py::gil_scoped_release release;
                make_group(g, DocumentShuffle{seed, epoch, group}, shard, lo, hi, offsets.data(), item, per_doc);
            }
            auto array = [](const std::vector<uint64_t>& v) {
                py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
                std::copy(v.begin(), v.end(), out.mutable_data());
                return out;
            };
            return py::make_tuple(array(g.bounds), array(g.order), array(g.ends));
        },
        py::arg("offsets"), py::arg("item"), py::arg("per_doc"), py::arg("seed"), py::arg("epoch"), py::arg("shard"),
        py::arg("lo"), py::arg("hi"), py::arg("group"),
        "(bounds, order, ends) of a group of TokenWindows' shuffled document order, as int64 arrays: the "
        "one rule of the Loader's threads (offsets: a shard's index, or the stream's token starts with item 1 "
        "and per_doc 0 for shard -1).");
    m.def(
        "locate_in_shard",
        [](const py::array_t<uint64_t, py::array::c_style>& offsets, uint64_t item, uint64_t per_doc, uint64_t t) {
            if (offsets.ndim() != 1 || offsets.size() < 2 || item == 0) {
                throw py::value_error("offsets must be a shard's offsets index (1-D, 2 or more) and item >= 1");
            }
            DocumentAt at =
                locate_in_shard(offsets.data(), static_cast<uint64_t>(offsets.size()) - 1, item, per_doc, t);
            return py::make_tuple(at.record, at.offset);
        },
        py::arg("offsets"), py::arg("item"), py::arg("per_doc"), py::arg("token"),
        "(record, offset): where token t of a shard's stream lies (each record's tokens, then per_doc eod "
        "tokens), by a binary search of its offsets index: the one rule of TokenWindows and the Loader.");
    m.def("collate_batch", &collate_batch, py::arg("spec"), py::arg("store"), py::arg("indices"),
          py::arg("pinned") = false,
          "One TokenCollator batch of `store`'s records at `indices`, gathered with the GIL released: "
          "(tokens, lengths, cu_seqlens or None, indices or None) as numpy arrays over one buffer.");
    m.def("pinned_blocks_available", &pinned_blocks_available,
          "Whether batch buffers can be page-locked here (the CUDA runtime is loaded).");

    py::class_<PyBatcher>(m, "Batcher")
        .def(py::init<py::handle, const CollateSpec&, size_t, size_t, bool>(), py::arg("store"), py::arg("spec"),
             py::arg("threads"), py::arg("depth"), py::arg("pinned") = false)
        .def("submit_from", checked(&PyBatcher::submit_from), py::arg("iterator"), py::arg("batch_size"),
             py::arg("max_batches"), py::arg("drop_last"))
        .def("submit_array", checked(&PyBatcher::submit_array), py::arg("indices"), py::arg("batch_size"),
             py::arg("drop_last"))
        .def("submit_bins", checked(&PyBatcher::submit_bins), py::arg("indices"), py::arg("rows"))
        .def("next", checked(&PyBatcher::next))
        .def("pending", checked(&PyBatcher::pending))
        .def_property_readonly("threads", checked(&PyBatcher::threads))
        .def_property_readonly("depth", checked(&PyBatcher::depth))
        .def("close", checked(&PyBatcher::close));
}

}  // namespace smstore::bindings
