#include "claims.hpp"

namespace smstore {

int64_t claim_state(const int64_t* word) noexcept {
    return __atomic_load_n(word, __ATOMIC_ACQUIRE);
}

int64_t claim(int64_t* word, int64_t token) noexcept {
    int64_t seen = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    // A ready word is only read: a compare-and-swap would take its cache line from every reader.
    if (seen != kClaimEmpty) return seen;
    if (__atomic_compare_exchange_n(word, &seen, token, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return kClaimEmpty;
    return seen;  // another process claimed it first (or it became ready)
}

bool publish(int64_t* word, int64_t token) noexcept {
    int64_t expected = token;
    return __atomic_compare_exchange_n(word, &expected, kClaimReady, false, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

bool abandon(int64_t* word, int64_t token) noexcept {
    int64_t expected = token;
    return __atomic_compare_exchange_n(word, &expected, kClaimEmpty, false, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

uint64_t reset_claims(int64_t* words, uint64_t n, int64_t token) noexcept {
    uint64_t reset = 0;
    for (uint64_t i = 0; i < n; ++i) {
        if (__atomic_load_n(&words[i], __ATOMIC_RELAXED) == token && abandon(&words[i], token)) ++reset;
    }
    return reset;
}

uint64_t count_ready(const int64_t* words, uint64_t n) noexcept {
    uint64_t ready = 0;
    for (uint64_t i = 0; i < n; ++i)
        ready += __atomic_load_n(&words[i], __ATOMIC_RELAXED) == kClaimReady;
    return ready;
}

void counter_add(uint64_t* counter, uint64_t amount) noexcept {
    __atomic_fetch_add(counter, amount, __ATOMIC_RELAXED);
}

uint64_t counter_read(const uint64_t* counter) noexcept {
    return __atomic_load_n(counter, __ATOMIC_RELAXED);
}

}  // namespace smstore
