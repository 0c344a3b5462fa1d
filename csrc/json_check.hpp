// A strict RFC 8259 JSON syntax check, for validating JSON Lines input without building objects.
#pragma once

#include <cstddef>
#include <string>

namespace smstore {

// True when [data, data+size) is exactly one JSON value (surrounding whitespace allowed). On false,
// *why says what is wrong and *column (1-based byte) where. Nesting deeper than 512 is refused.
bool json_valid(const char* data, size_t size, std::string* why, size_t* column);

}  // namespace smstore
