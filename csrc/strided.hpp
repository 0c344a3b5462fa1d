// A rank's share of a pass: the strided positions every order evaluates, its padding wrapped.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace smstore {

// Calls image(p, i) for p = (first + i * step) mod wrap, i < count. Throws std::overflow_error if
// first + (count - 1) * step does not fit in 64 bits, and std::out_of_range if wrap is 0 or above
// the order's size while count is not 0.
template <class Image>
void for_strided(uint64_t first, uint64_t step, size_t count, uint64_t wrap, uint64_t size, Image&& image) {
    if (count == 0) return;
    if (wrap == 0 || wrap > size) {
        throw std::out_of_range("positions wrap at " + std::to_string(wrap) + ", outside an order of " +
                                std::to_string(size));
    }
    uint64_t span = 0, last = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(count - 1), step, &span) ||
        __builtin_add_overflow(first, span, &last)) {
        throw std::overflow_error("strided positions past 2**64");
    }
    uint64_t p = first;
    for (size_t i = 0; i < count; ++i, p += step)
        image(p < wrap ? p : p % wrap, i);
}

}  // namespace smstore
