// Claims on the records of a node cache's chunk: one int64 word per record, in shared memory that
// every process filling or reading the cache maps (smstore/loading/node_cache.py).
//
// A word is kClaimEmpty (nobody has the record), kClaimReady (its row is written in full: readers
// may use it), or the token of the one process writing it (a positive number the daemon gave that
// process's connection). Only the claimant writes the row, and it publishes the word with release
// ordering after the row; a reader that loads kClaimReady with acquire ordering sees the whole
// row. A claimant that dies leaves its token: the daemon, which sees its connection close, resets
// its words to kClaimEmpty (reset_claims), so its half-written rows are never published.
#pragma once

#include <cstdint>

namespace smstore {

inline constexpr int64_t kClaimEmpty = 0;
inline constexpr int64_t kClaimReady = -1;

// The word's state, read with acquire ordering.
int64_t claim_state(const int64_t* word) noexcept;

// Claims an empty word for `token` (> 0). Returns kClaimReady if the row is ready, kClaimEmpty if
// the caller now holds the claim (and must publish or abandon it), else the current claimant's token.
int64_t claim(int64_t* word, int64_t token) noexcept;

// The caller's row is written: the word goes from `token` to kClaimReady (release ordering).
// False if the word no longer holds `token` (the daemon reset it): nothing is published.
bool publish(int64_t* word, int64_t token) noexcept;

// The caller gives its claim up without writing (the transform raised): `token` -> kClaimEmpty.
bool abandon(int64_t* word, int64_t token) noexcept;

// Every word of `n` that holds `token` goes back to kClaimEmpty; returns how many did.
uint64_t reset_claims(int64_t* words, uint64_t n, int64_t token) noexcept;

// How many of `n` words are kClaimReady.
uint64_t count_ready(const int64_t* words, uint64_t n) noexcept;

// Adds `amount` to a shared counter (relaxed: counters are statistics).
void counter_add(uint64_t* counter, uint64_t amount) noexcept;

// A shared counter's value.
uint64_t counter_read(const uint64_t* counter) noexcept;

}  // namespace smstore
