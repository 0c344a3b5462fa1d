// smstore._core claim functions: the node cache's per-record claims and counters in shared memory.
#include <pybind11/numpy.h>

#include <string>

#include "claims.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace smstore::bindings {
namespace {

using Words = py::array_t<int64_t, py::array::c_style>;
using Counters = py::array_t<uint64_t, py::array::c_style>;

// Word `i` of a writable 1-D int64 array (an IndexError outside it).
int64_t* word_at(Words& words, int64_t i) {
    const auto n = static_cast<int64_t>(flat_size(words, "words"));
    if (i < 0 || i >= n) throw py::index_error("word " + std::to_string(i) + " of " + std::to_string(n));
    return words.mutable_data() + i;
}

uint64_t* counter_at(Counters& counters, int64_t i) {
    const auto n = static_cast<int64_t>(flat_size(counters, "counters"));
    if (i < 0 || i >= n) throw py::index_error("counter " + std::to_string(i) + " of " + std::to_string(n));
    return counters.mutable_data() + i;
}

void check_token(int64_t token) {
    if (token <= 0) throw py::value_error("a claim token is positive, not " + std::to_string(token));
}

// A binding of `f`, an operation on record `i`'s word for a claimant's `token`.
template <typename R>
auto on_word(R (*f)(int64_t*, int64_t) noexcept) {
    return [f](Words words, int64_t i, int64_t token) {
        check_token(token);
        return f(word_at(words, i), token);
    };
}

}  // namespace

void register_claims(py::module_& m) {
    m.attr("CLAIM_EMPTY") = kClaimEmpty;
    m.attr("CLAIM_READY") = kClaimReady;
    m.def(
        "claim_state", [](Words words, int64_t i) { return claim_state(word_at(words, i)); },
        py::arg("words").noconvert(), py::arg("i"),
        "Word `i`'s state (acquire): CLAIM_EMPTY, CLAIM_READY or a claimant's token.");
    m.def("claim", on_word(&claim), py::arg("words").noconvert(), py::arg("i"), py::arg("token"),
          "Claim record `i` for `token`: CLAIM_READY (its row is ready), CLAIM_EMPTY (the caller holds "
          "the claim now) or the token of the process that holds it.");
    m.def("claim_publish", on_word(&publish), py::arg("words").noconvert(), py::arg("i"), py::arg("token"),
          "Publish record `i`'s written row (release); False if the claim is no longer `token`'s.");
    m.def("claim_abandon", on_word(&abandon), py::arg("words").noconvert(), py::arg("i"), py::arg("token"),
          "Give up the claim on record `i` unwritten.");
    m.def(
        "claims_reset",
        [](Words words, int64_t token) {
            check_token(token);
            const size_t n = flat_size(words, "words");
            return reset_claims(words.mutable_data(), n, token);
        },
        py::arg("words").noconvert(), py::arg("token"), "Every word holding `token` back to CLAIM_EMPTY; how many.");
    m.def(
        "claims_ready", [](const Words& words) { return count_ready(words.data(), flat_size(words, "words")); },
        py::arg("words").noconvert(), "How many words are CLAIM_READY.");
    m.def(
        "counter_add",
        [](Counters counters, int64_t i, uint64_t amount) { counter_add(counter_at(counters, i), amount); },
        py::arg("counters").noconvert(), py::arg("i"), py::arg("amount"), "Add to shared counter `i` (relaxed).");
    m.def(
        "counter_read", [](Counters counters, int64_t i) { return counter_read(counter_at(counters, i)); },
        py::arg("counters").noconvert(), py::arg("i"), "Shared counter `i`'s value.");
}

}  // namespace smstore::bindings
