// The npy-lines packer: parses integer text in a streaming loop and writes typed array records.
#include "npy_lines.hpp"

#include <cstring>
#include <limits>

#include "error.hpp"
#include "line_scanner.hpp"

namespace smstore {

std::string IntDtype::name() const {
    return std::string(kind == 'u' ? "uint" : "int") + std::to_string(itemsize * 8);
}

namespace {

bool is_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

std::string shown(const char* p, size_t n) {
    constexpr size_t kMax = 40;
    std::string s(p, n < kMax ? n : kMax);
    for (char& c : s) {
        if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f) c = '?';
    }
    return n > kMax ? s + "..." : s;
}

template <typename T>
class LineParser {
public:
    LineParser(Writer& writer, IntDtype dtype) : writer_(writer), dtype_(dtype) {}

    // One complete line, without its '\n'.
    void line(const std::string& file, uint64_t line_no, const char* p, size_t n) {
        values_.clear();
        const char* end = p + n;
        const char* start = p;
        while (p < end) {
            if (is_space(*p)) {
                ++p;
                continue;
            }
            const char* tok = p;
            while (p < end && !is_space(*p))
                ++p;
            values_.push_back(parse(file, line_no, static_cast<size_t>(tok - start) + 1, tok, p));
            if (values_.size() == kFlushEvery) flush();
        }
        flush();
        writer_.end_record();
    }

private:
    // Values go to the writer in batches: a long line of int64 would otherwise take 4x its length.
    static constexpr size_t kFlushEvery = (64 << 10) / sizeof(T);

    void flush() {
        if (values_.empty()) return;  // data() may be null: memcpy from it is undefined even for 0 bytes
        writer_.write_data(values_.data(), values_.size() * sizeof(T));
        values_.clear();
    }

    [[noreturn]] void fail(const std::string& file, uint64_t line_no, size_t column, const std::string& why) {
        throw Error(Error::Kind::Input,
                    file + ":" + std::to_string(line_no) + ": column " + std::to_string(column) + ": " + why);
    }

    T parse(const std::string& file, uint64_t line_no, size_t column, const char* p, const char* end) {
        const char* tok = p;
        auto len = static_cast<size_t>(end - p);
        bool negative = false;
        if (*p == '-' || *p == '+') negative = *p++ == '-';
        if (p == end) fail(file, line_no, column, "bad token '" + shown(tok, len) + "': not an integer");
        uint64_t magnitude = 0;
        bool overflow = false;
        for (; p < end; ++p) {
            auto digit = static_cast<unsigned>(*p - '0');
            if (digit > 9) fail(file, line_no, column, "bad token '" + shown(tok, len) + "': not an integer");
            overflow |= __builtin_mul_overflow(magnitude, 10u, &magnitude);
            overflow |= __builtin_add_overflow(magnitude, digit, &magnitude);
        }
        constexpr auto lo = std::numeric_limits<T>::min();
        constexpr auto hi = std::numeric_limits<T>::max();
        // Magnitudes compare as unsigned: -lo fits in uint64_t for every signed T.
        const uint64_t limit =
            negative ? static_cast<uint64_t>(-(static_cast<__int128>(lo))) : static_cast<uint64_t>(hi);
        if (overflow || magnitude > limit) {
            fail(file, line_no, column,
                 "value " + shown(tok, len) + " out of range for " + dtype_.name() + " [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
        }
        if (negative) return static_cast<T>(-static_cast<__int128>(magnitude));
        return static_cast<T>(magnitude);
    }

    Writer& writer_;
    IntDtype dtype_;
    std::vector<T> values_;
};

template <typename T>
uint64_t pack_typed(Writer& writer, const std::vector<InputSpan>& inputs, IntDtype dtype, PackProgress* progress,
                    uint64_t max_line) {
    LineParser<T> parser(writer, dtype);
    LineJoiner joiner(max_line);
    return scan_lines(inputs, progress,
                      [&](const std::string& file, uint64_t line_no, const char* p, size_t n, bool starts, bool ends) {
                          if (joiner.add(file, line_no, p, n, starts, ends)) parser.line(file, line_no, p, n);
                      });
}

}  // namespace

uint64_t pack_npy_lines(Writer& writer, const std::vector<InputSpan>& inputs, IntDtype dtype, PackProgress* progress,
                        uint64_t max_line) {
    if (dtype.kind == 'u') {
        switch (dtype.itemsize) {
            case 1:
                return pack_typed<uint8_t>(writer, inputs, dtype, progress, max_line);
            case 2:
                return pack_typed<uint16_t>(writer, inputs, dtype, progress, max_line);
            case 4:
                return pack_typed<uint32_t>(writer, inputs, dtype, progress, max_line);
            case 8:
                return pack_typed<uint64_t>(writer, inputs, dtype, progress, max_line);
            default:
                break;
        }
    } else if (dtype.kind == 'i') {
        switch (dtype.itemsize) {
            case 1:
                return pack_typed<int8_t>(writer, inputs, dtype, progress, max_line);
            case 2:
                return pack_typed<int16_t>(writer, inputs, dtype, progress, max_line);
            case 4:
                return pack_typed<int32_t>(writer, inputs, dtype, progress, max_line);
            case 8:
                return pack_typed<int64_t>(writer, inputs, dtype, progress, max_line);
            default:
                break;
        }
    }
    throw Error(Error::Kind::Input,
                std::string("npy-lines packs integer dtypes (int8..int64, uint8..uint64), not kind '") + dtype.kind +
                    "' of " + std::to_string(dtype.itemsize) + " bytes");
}

}  // namespace smstore
