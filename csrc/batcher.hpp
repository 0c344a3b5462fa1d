// Token batches at memory speed: records of a Store or a sharded dataset gathered, widened and padded
// or packed (as smstore.TokenCollator does) by C++ threads into a ring of reusable buffers.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "records.hpp"
#include "tokens.hpp"

namespace smstore {

// The element types a batch reads and writes (native byte order).
// (register_loader.cpp names them by numpy code in this order.)
enum class Dtype : uint8_t { U8, I8, U16, I16, U32, I32, U64, I64, F32, F64 };
size_t dtype_size(Dtype d) noexcept;

// TokenCollator's options, resolved.
struct CollateSpec {
    bool pack = false;
    Dtype in = Dtype::U8;              // a record is a run of these
    Dtype out = Dtype::U8;             // the tokens tensor's type (float records never go to integers)
    int64_t pad_value = 0;             // checked by the caller to fit `out`
    uint64_t max_length = UINT64_MAX;  // records are cut to this many items
    bool truncate_left = false;        // keep the last max_length items instead of the first
    bool pad_left = false;
    bool fixed_length = false;  // pad to max_length, not to the longest record
    uint64_t multiple = 1;      // the padded width is rounded up to a multiple of this
    bool with_indices = false;  // also write the batch's record indices (int64)
    // Token windows instead of records: an index is a window of this stream, gathered as its
    // segments into a row of length + 1 tokens (lengths all length + 1; the options above but
    // `in`, `out` and `with_indices` unused).
    std::shared_ptr<const TokenStream> windows;
    // Packed bins instead of records (PackedBins): each batch comes with its bins' segments, each
    // bin gathered into a row of `bin_length` tokens (`pad_value` after its own), with position ids
    // and cu_seqlens as PackedBins.collate makes them (`in`, `out`, `with_indices` used too).
    bool bins = false;
    uint64_t bin_length = 0;
    bool has_eod = false;
    int64_t eod = 0;
};

// Where the parts of one collated batch lie in its buffer (byte offsets, each 64-byte aligned).
// pad: tokens [rows, width]; pack: tokens [width] (all records back to back) and cu_seqlens
// [rows + 1] (int32, or int64 when cu_int64). lengths [rows] (int64, after truncation), and
// indices [rows] (int64) when asked for.
struct BatchLayout {
    uint64_t rows = 0;
    uint64_t width = 0;
    bool cu_int64 = false;
    uint64_t tokens_at = 0, lengths_at = 0, cu_at = 0, indices_at = 0, bytes = 0;
    // Packed bins: position ids [rows, width] (int64) at lengths_at, and cu_count cu_seqlens (int32).
    uint64_t cu_count = 0;
};

// Checks the batch (every index below records.size(), its shard open, every record inside its data
// section and a whole number of items) and returns its layout; for token windows, also lists the
// windows' segments in `segments` (cleared first). Throws Error.
BatchLayout plan_batch(const Records& records, const CollateSpec& spec, const uint64_t* indices, size_t n,
                       std::vector<Segment>& segments);
// Packed bins: the batch of bins whose segments are `rows` ((row in the batch, document, first,
// count) int64, rows in order, `count` of them), listed in `segments`. Throws Error.
BatchLayout plan_bins(const Records& records, const CollateSpec& spec, size_t n, const int64_t* rows, size_t count,
                      std::vector<Segment>& segments);
// Writes the batch planned by plan_batch (with its segments) into out (layout.bytes, 64-byte aligned).
void fill_batch(const Records& records, const CollateSpec& spec, const uint64_t* indices, size_t n,
                const BatchLayout& layout, const std::vector<Segment>& segments, unsigned char* out) noexcept;

// Memory a batch is written to; page-locked (through the CUDA runtime already loaded in this
// process) when asked for and possible. Owned through shared_ptr: a buffer handed to Python is
// kept alive, and never written again, while anything there holds it.
class Block {
public:
    Block(size_t capacity, bool pinned);
    ~Block();
    Block(const Block&) = delete;
    Block& operator=(const Block&) = delete;
    unsigned char* data() const noexcept { return data_; }
    size_t capacity() const noexcept { return capacity_; }
    bool pinned() const noexcept { return pinned_; }

private:
    unsigned char* data_ = nullptr;
    size_t capacity_ = 0;
    bool pinned_ = false;
};

// Whether page-locked blocks can be had here (the CUDA runtime is loaded in this process).
bool pinned_blocks_available() noexcept;

// One collated batch ready for the consumer.
struct ReadyBatch {
    std::shared_ptr<Block> block;
    BatchLayout layout;
};

// Batches in submission order, prepared by `threads` threads at most `depth` ahead of the
// consumer (and by the consumer itself while the batch it asks for is not ready: it makes the
// next one no thread has started, within the same window, rather than wait; with no threads,
// every batch is made in next()). A sleeping thread is woken when half the window is free.
// The threads work ahead only while the consumer spends longer away between batches (its loop's
// body) than twice a batch takes to make, or a batch takes 50 us or more to make: a loop that
// does little besides asking for small batches makes them itself (a hand-over costs about what it
// saves there, and a thread that another process preempts mid-batch stalls the loop), while a
// loop with a real step gets them made during the step, and large batches are made by several
// threads at once. Which thread makes a batch never changes its bytes. Slot s of depth + 2 holds
// batch s, s + depth + 2, ...: when next() hands out batch k the threads may start batch k + depth, whose slot last
// held k - 2, so the batch the consumer still holds (k - 1) is not the one they refill. A slot whose block is still
// held elsewhere (a shared_ptr besides the slot's) gets a new block instead of being overwritten.
class Batcher {
public:
    // `label` names the data in the errors of the Batcher itself (closed, nothing pending).
    Batcher(std::string label, CollateSpec spec, size_t threads, size_t depth, bool pinned);
    ~Batcher();  // stops and joins the threads
    Batcher(const Batcher&) = delete;
    Batcher& operator=(const Batcher&) = delete;

    // Queues batches of `records`: `indices` split into runs of `sizes` (each index below
    // records.size(), in a shard open in `records`). The batches keep `records`, and so the stores
    // they read, until they are made.
    void submit(std::shared_ptr<const Records> records, const uint64_t* indices, const uint64_t* sizes, size_t batches);
    // Queues one batch of packed bins: `indices` and the bins' segment rows (see plan_bins).
    void submit_bins(std::shared_ptr<const Records> records, std::vector<uint64_t> indices, std::vector<int64_t> rows);
    // Batches submitted that the consumer has not received yet.
    uint64_t pending() const;
    // Waits for the next batch (blocking; call without the GIL). Rethrows the error that batch met.
    // Throws Error(Closed) after close() or when nothing is pending.
    ReadyBatch next();
    // Stops the threads and joins them; batches not received are dropped. Idempotent.
    void close() noexcept;
    size_t threads() const noexcept { return threads_.size(); }
    size_t depth() const noexcept { return depth_; }
    // Whether this process is a fork() child of the one that made the Batcher: its threads, and
    // perhaps a lock one held, stayed in the parent. Such a Batcher must never be used or
    // destroyed (its owner leaks it): every call throws Error(Closed).
    bool forked() const noexcept;

private:
    struct Slot {
        std::shared_ptr<Block> block;
        BatchLayout layout;
        std::exception_ptr error;
        int64_t filled = -1;  // the sequence number of the batch it holds, once written
    };
    struct Job {  // a submitted batch
        std::vector<uint64_t> indices;
        std::shared_ptr<const Records> records;
        std::vector<int64_t> rows;  // packed bins' segments (see plan_bins)
    };
    void work() noexcept;
    // Takes the next queued batch and makes it into its slot: `lock` is held on entry and on
    // return, released meanwhile. The caller has checked that one is queued.
    void make_next(std::unique_lock<std::mutex>& lock) noexcept;
    void fill(Slot& slot, const Job& job);

    std::string label_;
    CollateSpec spec_;
    size_t depth_;
    bool pinned_;
    std::vector<Slot> slots_;  // depth_ + 2
    std::deque<Job> queue_;    // submitted batches not yet taken by a thread
    uint64_t submitted_ = 0, taken_ = 0, received_ = 0;
    size_t idle_threads_ = 0;      // threads waiting on work_cv_
    size_t consumer_waiting_ = 0;  // next() waiting on ready_cv_
    // Whether the threads work ahead (see next()): the consumer's time away between batches and
    // the time a batch takes to make, each a moving average in nanoseconds.
    bool prefetch_ = true;
    int64_t away_ns_ = 0, fill_ns_ = 0;
    std::chrono::steady_clock::time_point returned_{};  // when next() last returned
    bool stop_ = false;
    mutable std::mutex mutex_;
    std::condition_variable work_cv_, ready_cv_;
    std::vector<std::thread> threads_;
    uint64_t fork_generation_;
};

}  // namespace smstore
