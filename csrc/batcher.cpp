// Batcher: TokenCollator's gather, truncation, widening and padding in one pass per record, on C++ threads.
#include "batcher.hpp"

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>

#include "error.hpp"

namespace smstore {
namespace {

constexpr uint64_t kAlign = 64;

// Forks this process has gone through (counted in the child): a Batcher made before one is a
// shell whose threads live in the parent.
std::atomic<uint64_t> g_forks{0};

void count_fork_in_child() {
    g_forks.fetch_add(1, std::memory_order_relaxed);
}

uint64_t fork_generation() {
    static const bool registered = [] { return ::pthread_atfork(nullptr, nullptr, count_fork_in_child) == 0; }();
    (void)registered;
    return g_forks.load(std::memory_order_relaxed);
}

uint64_t align_up(uint64_t v) {
    return (v + kAlign - 1) & ~(kAlign - 1);
}

uint64_t mul_checked(uint64_t a, uint64_t b, const std::string& label) {
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r)) {
        throw Error(Error::Kind::Format, label + ": the batch asked for is larger than 2^64 bytes");
    }
    return r;
}

// The CUDA runtime's host allocator, when the process has loaded it (torch with CUDA does).
// Looked up, never linked: the core builds and runs without CUDA.
struct CudaHost {
    using Alloc = int (*)(void**, size_t, unsigned);
    using Free = int (*)(void*);
    Alloc alloc = nullptr;
    Free free = nullptr;
};

const CudaHost& cuda_host() {
    static const CudaHost found = [] {
        CudaHost h;
        void* lib = RTLD_DEFAULT;
        void* sym = ::dlsym(lib, "cudaHostAlloc");
        if (!sym) {
            for (const char* name : {"libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"}) {
                lib = ::dlopen(name, RTLD_NOW | RTLD_NOLOAD);  // only one already loaded: never starts CUDA
                if (lib && (sym = ::dlsym(lib, "cudaHostAlloc"))) break;
            }
        }
        void* free_sym = sym ? ::dlsym(lib, "cudaFreeHost") : nullptr;
        if (sym && free_sym) {
            h.alloc = reinterpret_cast<CudaHost::Alloc>(sym);
            h.free = reinterpret_cast<CudaHost::Free>(free_sym);
        }
        return h;
    }();
    return found;
}

template <typename In, typename Out>
void copy_widen(Out* dst, const unsigned char* src, uint64_t count) noexcept {
    if constexpr (std::is_same_v<In, Out>) {
        std::memcpy(dst, src, count * sizeof(In));
    } else {
        In buf[256];  // records need not be aligned to their item size
        while (count) {
            uint64_t m = std::min<uint64_t>(count, 256);
            std::memcpy(buf, src, m * sizeof(In));
            for (uint64_t j = 0; j < m; ++j)
                dst[j] = static_cast<Out>(buf[j]);
            dst += m;
            src += m * sizeof(In);
            count -= m;
        }
    }
}

template <typename Out>
void fill_value(Out* dst, uint64_t count, Out value) noexcept {
    if (count) std::fill(dst, dst + count, value);
}

// Where record indices[k] lies: its offsets (begin at [0], end at [1]) and its shard's data section.
struct At {
    const uint64_t* offsets;
    const unsigned char* data;
};

template <bool Sharded>
At record_at(const Records& r, uint64_t i) noexcept {
    if constexpr (Sharded) {
        auto [k, j] = r.locate(i);
        return {r.offsets(k) + j, r.data(k)};
    } else {
        return {r.offsets(0) + i, r.data(0)};
    }
}

template <typename In, typename Out, bool Sharded>
void fill_typed(const Records& records, const CollateSpec& spec, const uint64_t* indices, size_t n,
                const BatchLayout& l, unsigned char* out) noexcept {
    auto* tokens = reinterpret_cast<Out*>(out + l.tokens_at);
    auto* lengths = reinterpret_cast<int64_t*>(out + l.lengths_at);
    const Out pad = static_cast<Out>(spec.pad_value);
    uint64_t pos = 0;  // pack: tokens written so far
    // Records lie at random places: without prefetching, the widening loop of one record fills the
    // core's window before the next record's cache misses start (4x slower into int64 than with).
    constexpr size_t kAheadIndex = 16, kAheadData = 8;
    for (size_t k = 0; k < std::min(n, kAheadIndex); ++k)
        __builtin_prefetch(record_at<Sharded>(records, indices[k]).offsets);
    for (size_t k = 0; k < n; ++k) {
        if (k + kAheadIndex < n) __builtin_prefetch(record_at<Sharded>(records, indices[k + kAheadIndex]).offsets);
        if (k + kAheadData < n) {
            At a = record_at<Sharded>(records, indices[k + kAheadData]);
            const unsigned char* ahead = a.data + a.offsets[0];
            const unsigned char* last = a.data + a.offsets[1];
            for (const unsigned char* p = ahead; p < last && p < ahead + 1024; p += 64)
                __builtin_prefetch(p);
        }
        At a = record_at<Sharded>(records, indices[k]);
        uint64_t b = a.offsets[0], e = a.offsets[1];
        uint64_t items = (e - b) / sizeof(In);
        uint64_t kept = std::min(items, spec.max_length);
        const unsigned char* src = a.data + b + (spec.truncate_left ? (items - kept) * sizeof(In) : 0);
        lengths[k] = static_cast<int64_t>(kept);
        if (spec.pack) {
            copy_widen<In, Out>(tokens + pos, src, kept);
            pos += kept;
            continue;
        }
        Out* row = tokens + k * l.width;
        if (spec.pad_left) {
            fill_value(row, l.width - kept, pad);
            copy_widen<In, Out>(row + (l.width - kept), src, kept);
        } else {
            copy_widen<In, Out>(row, src, kept);
            fill_value(row + kept, l.width - kept, pad);
        }
    }
    if (spec.pack) {
        if (l.cu_int64) {
            auto* cu = reinterpret_cast<int64_t*>(out + l.cu_at);
            cu[0] = 0;
            for (size_t k = 0; k < n; ++k)
                cu[k + 1] = cu[k] + lengths[k];
        } else {
            auto* cu = reinterpret_cast<int32_t*>(out + l.cu_at);
            cu[0] = 0;
            for (size_t k = 0; k < n; ++k)
                cu[k + 1] = cu[k] + static_cast<int32_t>(lengths[k]);
        }
    }
    if (spec.with_indices) {
        auto* idx = reinterpret_cast<int64_t*>(out + l.indices_at);
        for (size_t k = 0; k < n; ++k)
            idx[k] = static_cast<int64_t>(indices[k]);
    }
}

// Writes the segments back to back at dst: each one's tokens (widened), then its fill tokens.
// Returns the end of what it wrote.
template <typename In, typename Out>
Out* gather_segments(const Records& records, const Segment* segments, size_t count, Out* dst, Out fill) noexcept {
    for (size_t m = 0; m < count; ++m) {
        const Segment& s = segments[m];
        auto [k, j] = records.locate(s.document);
        copy_widen<In, Out>(dst, records.data(k) + records.offsets(k)[j] + s.first * sizeof(In), s.count);
        dst += s.count;
        fill_value(dst, s.fill, fill);
        dst += s.fill;
    }
    return dst;
}

// Token windows: row k is the segments of window indices[k], width (length + 1) tokens in all.
template <typename In, typename Out>
void fill_windows(const Records& records, const CollateSpec& spec, const uint64_t* indices, size_t n,
                  const BatchLayout& l, const std::vector<Segment>& segments, unsigned char* out) noexcept {
    auto* tokens = reinterpret_cast<Out*>(out + l.tokens_at);
    auto* lengths = reinterpret_cast<int64_t*>(out + l.lengths_at);
    const Out eod = static_cast<Out>(spec.windows->eod);
    const Segment* seg = segments.data();
    for (size_t k = 0; k < n; ++k) {
        Out* row = tokens + k * l.width;
        const Segment* first = seg;
        for (uint64_t filled = 0; filled < l.width; ++seg)
            filled += seg->count + seg->fill;
        gather_segments<In, Out>(records, first, static_cast<size_t>(seg - first), row, eod);
        lengths[k] = static_cast<int64_t>(l.width);
    }
    if (spec.with_indices) {
        auto* idx = reinterpret_cast<int64_t*>(out + l.indices_at);
        for (size_t k = 0; k < n; ++k)
            idx[k] = static_cast<int64_t>(indices[k]);
    }
}

// Packed bins: row k is bin k's segments, then pad tokens to the row's width; its position ids
// count from 0 in each segment (0 on padding), and cu_seqlens run over the rows flattened, each
// row's padding a sequence of its own (PackedBins.collate).
template <typename In, typename Out>
void fill_bins(const Records& records, const CollateSpec& spec, const uint64_t* indices, size_t n, const BatchLayout& l,
               const std::vector<Segment>& segments, unsigned char* out) noexcept {
    auto* tokens = reinterpret_cast<Out*>(out + l.tokens_at);
    auto* positions = reinterpret_cast<int64_t*>(out + l.lengths_at);
    auto* cu = reinterpret_cast<int32_t*>(out + l.cu_at);
    const Segment* seg = segments.data();
    const Segment* end = seg + segments.size();
    *cu++ = 0;
    for (size_t k = 0; k < n; ++k) {
        Out* row = tokens + k * l.width;
        int64_t* pos = positions + k * l.width;
        const Segment* first = seg;
        uint64_t used = 0;
        for (; seg != end && seg->row == k; ++seg) {
            uint64_t count = seg->count + seg->fill;
            for (uint64_t p = 0; p < count; ++p)
                pos[used + p] = static_cast<int64_t>(p);
            used += count;
            *cu++ = static_cast<int32_t>(k * l.width + used);
        }
        Out* at =
            gather_segments<In, Out>(records, first, static_cast<size_t>(seg - first), row, static_cast<Out>(spec.eod));
        fill_value(at, l.width - used, static_cast<Out>(spec.pad_value));
        fill_value(pos + used, l.width - used, int64_t{0});
        if (used < l.width) *cu++ = static_cast<int32_t>((k + 1) * l.width);
    }
    if (spec.with_indices) {
        auto* idx = reinterpret_cast<int64_t*>(out + l.indices_at);
        for (size_t k = 0; k < n; ++k)
            idx[k] = static_cast<int64_t>(indices[k]);
    }
}

// Calls f with a value of the C++ type that d names (the one table from Dtype to types).
template <typename F>
decltype(auto) with_type(Dtype d, F&& f) {
    switch (d) {
        case Dtype::U8:
            return f(uint8_t{});
        case Dtype::I8:
            return f(int8_t{});
        case Dtype::U16:
            return f(uint16_t{});
        case Dtype::I16:
            return f(int16_t{});
        case Dtype::U32:
            return f(uint32_t{});
        case Dtype::I32:
            return f(int32_t{});
        case Dtype::U64:
            return f(uint64_t{});
        case Dtype::I64:
            return f(int64_t{});
        case Dtype::F32:
            return f(float{});
        case Dtype::F64:
            return f(double{});
    }
    return f(uint8_t{});  // not reached: every Dtype is listed
}

}  // namespace

size_t dtype_size(Dtype d) noexcept {
    return with_type(d, [](auto v) { return sizeof(v); });
}

// The layout of n rows of `width` tokens (pad), or of `total` tokens back to back (pack).
static BatchLayout layout_of(const CollateSpec& spec, size_t n, uint64_t width, uint64_t total,
                             const std::string& label) {
    BatchLayout l;
    l.rows = n;
    const uint64_t out_item = dtype_size(spec.out);
    uint64_t token_bytes;
    if (spec.pack) {
        l.width = total;
        l.cu_int64 = total >= (uint64_t{1} << 31);
        token_bytes = mul_checked(total, out_item, label);
    } else {
        l.width = width;
        if (spec.multiple > 1) l.width = (l.width + spec.multiple - 1) / spec.multiple * spec.multiple;
        token_bytes = mul_checked(mul_checked(l.width, n, label), out_item, label);
    }
    l.tokens_at = 0;
    l.lengths_at = align_up(token_bytes);
    uint64_t end = l.lengths_at + 8 * n;
    if (spec.pack) {
        l.cu_at = align_up(end);
        end = l.cu_at + (l.cu_int64 ? 8 : 4) * (n + 1);
    }
    if (spec.with_indices) {
        l.indices_at = align_up(end);
        end = l.indices_at + 8 * n;
    }
    l.bytes = align_up(std::max<uint64_t>(end, 1));
    return l;
}

// Token windows: each index a window of the stream, listed as its segments.
static BatchLayout plan_windows(const Records& records, const CollateSpec& spec, const uint64_t* indices, size_t n,
                                std::vector<Segment>& segments) {
    const TokenStream& stream = *spec.windows;
    const uint64_t count = stream.windows();
    for (size_t k = 0; k < n; ++k) {
        if (indices[k] >= count) {
            throw Error(Error::Kind::Index, records.label() + ": token window " + std::to_string(indices[k]) +
                                                " out of range for " + std::to_string(count) + " windows");
        }
        window_segments(records, stream, indices[k], segments);
    }
    return layout_of(spec, n, stream.length + 1, 0, records.label());
}

BatchLayout plan_bins(const Records& records, const CollateSpec& spec, size_t n, const int64_t* rows, size_t count,
                      std::vector<Segment>& segments) {
    segments.clear();
    const std::string& label = records.label();
    uint64_t cu = 1;
    for (size_t m = 0; m < count;) {
        auto k = static_cast<uint64_t>(rows[4 * m]);
        if (rows[4 * m] < 0 || k >= n || (m && k < segments.back().row)) {
            throw Error(Error::Kind::Format, label + ": a packed bin's segment names row " +
                                                 std::to_string(rows[4 * m]) + " of a batch of " + std::to_string(n) +
                                                 " bins (rows in order)");
        }
        size_t stop = m;
        while (stop < count && rows[4 * stop] == rows[4 * m])
            ++stop;
        size_t before = segments.size();
        uint64_t used =
            bin_segments(records, dtype_size(spec.in), spec.has_eod, rows + 4 * m + 1, stop - m, 4, segments);
        if (used > spec.bin_length) {
            throw Error(Error::Kind::Format, label + ": a packed bin of " + std::to_string(used) +
                                                 " tokens does not fit bins of " + std::to_string(spec.bin_length));
        }
        for (size_t q = before; q < segments.size(); ++q)
            segments[q].row = k;
        cu += (stop - m) + (used < spec.bin_length ? 1 : 0);
        m = stop;
    }
    // Rows with no segment (empty bins) are padding only.
    for (size_t k = 0, m = 0; k < n; ++k) {
        bool any = m < segments.size() && segments[m].row == k;
        while (m < segments.size() && segments[m].row == k)
            ++m;
        if (!any) ++cu;
    }
    BatchLayout l;
    l.rows = n;
    l.width = spec.bin_length;
    l.cu_count = cu;
    uint64_t cells = mul_checked(spec.bin_length, n, label);
    l.tokens_at = 0;
    l.lengths_at = align_up(mul_checked(cells, dtype_size(spec.out), label));
    l.cu_at = align_up(l.lengths_at + mul_checked(cells, 8, label));
    uint64_t end = l.cu_at + 4 * cu;
    if (spec.with_indices) {
        l.indices_at = align_up(end);
        end = l.indices_at + 8 * n;
    }
    l.bytes = align_up(std::max<uint64_t>(end, 1));
    return l;
}

BatchLayout plan_batch(const Records& records, const CollateSpec& spec, const uint64_t* indices, size_t n,
                       std::vector<Segment>& segments) {
    segments.clear();
    if (spec.windows) return plan_windows(records, spec, indices, n, segments);
    const uint64_t item = dtype_size(spec.in), count = records.size();
    const std::string& label = records.label();
    uint64_t longest = 0, total = 0;
    for (size_t k = 0; k < n; ++k) {
        if (k + 16 < n && indices[k + 16] < count) {
            auto [s, j] = records.locate(indices[k + 16]);
            if (records.offsets(s)) __builtin_prefetch(records.offsets(s) + j);
        }
        uint64_t i = indices[k];
        if (i >= count) {
            throw Error(Error::Kind::Index, label + ": record index " + std::to_string(i) + " out of range for " +
                                                std::to_string(count) + " records");
        }
        auto [s, j] = records.locate(i);
        const Store& shard = records.open_shard(s, i);
        uint64_t b = records.offsets(s)[j], e = records.offsets(s)[j + 1];
        if (!Store::span_inside(b, e, records.data_size(s))) throw shard.span_error(j, b, e);
        if ((e - b) % item) {
            throw Error(Error::Kind::Format, label + ": record " + std::to_string(i) + " of " + std::to_string(e - b) +
                                                 " bytes is not a whole number of " + std::to_string(item) +
                                                 "-byte items; the blob was written wrongly, re-pack it");
        }
        uint64_t kept = std::min((e - b) / item, spec.max_length);
        longest = std::max(longest, kept);
        total += kept;  // at most the data section's size: no overflow
    }
    return layout_of(spec, n, spec.fixed_length ? spec.max_length : longest, total, label);
}

void fill_batch(const Records& r, const CollateSpec& spec, const uint64_t* i, size_t n, const BatchLayout& l,
                const std::vector<Segment>& segments, unsigned char* out) noexcept {
    with_type(spec.in, [&](auto in) {
        with_type(spec.out, [&](auto to) {
            using In = decltype(in);
            using Out = decltype(to);
            if (spec.bins) {
                fill_bins<In, Out>(r, spec, i, n, l, segments, out);
            } else if (spec.windows) {
                fill_windows<In, Out>(r, spec, i, n, l, segments, out);
            } else if (r.sharded()) {
                fill_typed<In, Out, true>(r, spec, i, n, l, out);
            } else {
                fill_typed<In, Out, false>(r, spec, i, n, l, out);
            }
        });
    });
}

bool pinned_blocks_available() noexcept {
    return cuda_host().alloc != nullptr;
}

Block::Block(size_t capacity, bool pinned) : capacity_(std::max<size_t>(align_up(capacity), kAlign)) {
    if (pinned && pinned_blocks_available()) {
        void* p = nullptr;
        constexpr unsigned kPortable = 1;  // cudaHostAllocPortable: pinned for every CUDA context
        if (cuda_host().alloc(&p, capacity_, kPortable) == 0 && p) {
            data_ = static_cast<unsigned char*>(p);
            pinned_ = true;
            return;
        }
    }
    data_ = static_cast<unsigned char*>(std::aligned_alloc(kAlign, capacity_));
    if (!data_) throw std::bad_alloc();
}

Block::~Block() {
    if (pinned_) {
        cuda_host().free(data_);
    } else {
        std::free(data_);
    }
}

Batcher::Batcher(std::string label, CollateSpec spec, size_t threads, size_t depth, bool pinned)
    : label_(std::move(label)),
      spec_(spec),
      depth_(std::max<size_t>(depth, 1)),
      pinned_(pinned),
      slots_(depth_ + 2),
      fork_generation_(fork_generation()) {
    threads_.reserve(threads);
    try {
        for (size_t t = 0; t < threads; ++t)
            threads_.emplace_back([this] { work(); });
    } catch (...) {
        close();
        throw;
    }
}

Batcher::~Batcher() {
    close();
}

bool Batcher::forked() const noexcept {
    return fork_generation_ != g_forks.load(std::memory_order_relaxed);
}

static void refuse_if_forked(const Batcher& b, const std::string& label) {
    if (b.forked()) {
        throw Error(Error::Kind::Closed, label +
                                             ": this loader was started before fork(); its threads are in the "
                                             "parent process: start a new pass in this one");
    }
}

void Batcher::close() noexcept {
    if (forked()) return;  // the owner leaks a forked Batcher (see forked()); never lock or join here
    {
        std::lock_guard<std::mutex> lock(mutex_);
        stop_ = true;
    }
    work_cv_.notify_all();
    ready_cv_.notify_all();
    for (auto& t : threads_) {
        if (t.joinable()) t.join();
    }
}

void Batcher::submit(std::shared_ptr<const Records> records, const uint64_t* indices, const uint64_t* sizes,
                     size_t batches) {
    refuse_if_forked(*this, label_);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stop_) throw Error(Error::Kind::Closed, label_ + ": this loader is closed");
        for (size_t b = 0; b < batches; ++b) {
            queue_.push_back(Job{std::vector<uint64_t>(indices, indices + sizes[b]), records, {}});
            indices += sizes[b];
        }
        submitted_ += batches;
        if (!prefetch_ || !idle_threads_) return;  // no thread to wake, or none that would work now
    }
    work_cv_.notify_all();
}

void Batcher::submit_bins(std::shared_ptr<const Records> records, std::vector<uint64_t> indices,
                          std::vector<int64_t> rows) {
    refuse_if_forked(*this, label_);
    {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stop_) throw Error(Error::Kind::Closed, label_ + ": this loader is closed");
        queue_.push_back(Job{std::move(indices), std::move(records), std::move(rows)});
        submitted_ += 1;
        if (!prefetch_ || !idle_threads_) return;
    }
    work_cv_.notify_all();
}

uint64_t Batcher::pending() const {
    refuse_if_forked(*this, label_);
    std::lock_guard<std::mutex> lock(mutex_);
    return submitted_ - received_;
}

void Batcher::fill(Slot& slot, const Job& job) {
    const std::vector<uint64_t>& indices = job.indices;
    std::vector<Segment> segments;  // token windows' or bins' (none for records)
    BatchLayout l = spec_.bins
                        ? plan_bins(*job.records, spec_, indices.size(), job.rows.data(), job.rows.size() / 4, segments)
                        : plan_batch(*job.records, spec_, indices.data(), indices.size(), segments);
    // use_count() == 1: no batch handed out still holds this block. The fence pairs with the
    // release in the last holder's decrement, so its reads of the old batch come before our writes.
    bool reusable = slot.block && slot.block.use_count() == 1 && slot.block->capacity() >= l.bytes;
    std::atomic_thread_fence(std::memory_order_acquire);
    if (!reusable) {
        slot.block.reset();
        slot.block = std::make_shared<Block>(l.bytes + l.bytes / 4, pinned_);  // room to grow a little
    }
    fill_batch(*job.records, spec_, indices.data(), indices.size(), l, segments, slot.block->data());
    slot.layout = l;
}

void Batcher::make_next(std::unique_lock<std::mutex>& lock) noexcept {
    uint64_t seq = taken_++;
    Job job = std::move(queue_.front());
    queue_.pop_front();
    Slot& slot = slots_[seq % slots_.size()];
    lock.unlock();
    std::exception_ptr error;
    auto t0 = std::chrono::steady_clock::now();
    try {
        fill(slot, job);
    } catch (...) {
        error = std::current_exception();
    }
    auto took = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
    job = Job{};  // the last hold of a released shard unmaps it: not under the lock
    lock.lock();
    fill_ns_ += (took - fill_ns_) / 8;
    slot.error = error;
    slot.filled = static_cast<int64_t>(seq);
    if (consumer_waiting_) ready_cv_.notify_all();
}

void Batcher::work() noexcept {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
        while (!stop_ && !(prefetch_ && !queue_.empty() && taken_ < received_ + depth_)) {
            ++idle_threads_;
            work_cv_.wait(lock);
            --idle_threads_;
        }
        if (stop_) return;
        make_next(lock);
    }
}

ReadyBatch Batcher::next() {
    refuse_if_forked(*this, label_);
    std::unique_lock<std::mutex> lock(mutex_);
    if (received_ == submitted_ && !stop_) {
        throw Error(Error::Kind::Closed, label_ + ": no batch is pending (submit some first)");
    }
    auto now = std::chrono::steady_clock::now();
    if (returned_ != std::chrono::steady_clock::time_point{}) {
        auto away = std::chrono::duration_cast<std::chrono::nanoseconds>(now - returned_).count();
        away_ns_ += (away - away_ns_) / 8;
        // Hand-overs cost a few microseconds: worth it for a batch that takes long to make
        // (threads then make several at once), or while the loop has other work to overlap.
        constexpr int64_t kLongFillNs = 50'000;
        prefetch_ = fill_ns_ >= kLongFillNs || away_ns_ > 2 * fill_ns_;
    }
    Slot& slot = slots_[received_ % slots_.size()];
    while (!stop_ && slot.filled != static_cast<int64_t>(received_)) {
        if (!queue_.empty() && taken_ < received_ + depth_) {
            // The batch asked for is not ready (no thread has started it, or one is making it):
            // make the next batch not yet started here, exactly as a thread would, rather than
            // wait idle (on a busy machine the threads may be waiting for a core).
            make_next(lock);
            continue;
        }
        ++consumer_waiting_;
        ready_cv_.wait(lock);
        --consumer_waiting_;
    }
    if (stop_) throw Error(Error::Kind::Closed, label_ + ": this loader is closed");
    ++received_;
    // The window moved. Waking a sleeping thread costs a system call: do it once half the window
    // (or all of it, when the threads have nothing left in it) is free, not at every batch.
    uint64_t room = received_ + depth_ - taken_;
    if (prefetch_ && idle_threads_ && !queue_.empty() && (room >= (depth_ + 1) / 2 || taken_ == received_)) {
        work_cv_.notify_all();
    }
    returned_ = std::chrono::steady_clock::now();
    if (slot.error) std::rethrow_exception(slot.error);
    return ReadyBatch{slot.block, slot.layout};
}

}  // namespace smstore
