// Unmaps large mappings on a background thread, off the thread that dropped the last reference.
#pragma once

#include <cstddef>

namespace smstore {

// Mappings at least this large are unmapped in the background. Tearing down the page table of a
// mapping whose pages were read, and freeing those pages when it is the last mapping of a deleted
// shared-memory segment, costs about 0.5 ms per 10 MiB: a DataLoader worker that drops the last
// view of a window's shards would pay it between two batches (and, under a Python lock, so would
// every thread of its process). Below this size an inline munmap is cheaper than the hand-off.
constexpr size_t kBackgroundUnmapBytes = size_t{4} << 20;

// Unmaps [addr, addr + size) now if it is small, else queues it for the unmap thread (started on
// first use). The range must not be touched again by anyone. Never throws: if no thread can be
// started, it unmaps inline.
void unmap_later(void* addr, size_t size) noexcept;

// Blocks until every unmap queued so far has been done (for tests and deterministic shutdowns).
void wait_for_unmaps() noexcept;

}  // namespace smstore
