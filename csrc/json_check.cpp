// Recursive-descent JSON checker with a depth limit, so hostile input cannot overflow the stack.
#include "json_check.hpp"

namespace smstore {
namespace {

constexpr int kMaxDepth = 512;

class Checker {
public:
    Checker(const char* p, size_t n) : p_(p), end_(p + n), begin_(p) {}

    bool run(std::string* why, size_t* column) {
        ws();
        bool ok = value(0);
        if (ok) {
            ws();
            if (p_ != end_) ok = fail("unexpected data after the JSON value");
        }
        if (!ok) {
            *why = err_;
            *column = static_cast<size_t>(p_ - begin_) + 1;
        }
        return ok;
    }

private:
    bool fail(const char* what) {
        if (err_.empty()) err_ = what;
        return false;
    }
    void ws() {
        while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r'))
            ++p_;
    }
    bool literal(const char* word) {
        for (const char* w = word; *w; ++w, ++p_) {
            if (p_ == end_ || *p_ != *w) return fail("invalid literal");
        }
        return true;
    }
    static bool digit(char c) { return c >= '0' && c <= '9'; }
    static bool hex(char c) { return digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

    bool value(int depth) {
        if (p_ == end_) return fail("unexpected end of input");
        switch (*p_) {
            case '{':
                return object(depth + 1);
            case '[':
                return array(depth + 1);
            case '"':
                return string();
            case 't':
                return literal("true");
            case 'f':
                return literal("false");
            case 'n':
                return literal("null");
            default:
                return number();
        }
    }
    bool object(int depth) {
        if (depth > kMaxDepth) return fail("nesting too deep");
        ++p_;
        ws();
        if (p_ < end_ && *p_ == '}') return ++p_, true;
        for (;;) {
            ws();
            if (p_ == end_ || *p_ != '"') return fail("expected a string key");
            if (!string()) return false;
            ws();
            if (p_ == end_ || *p_ != ':') return fail("expected ':'");
            ++p_;
            ws();
            if (!value(depth)) return false;
            ws();
            if (p_ == end_) return fail("unterminated object");
            if (*p_ == ',') {
                ++p_;
                continue;
            }
            if (*p_ == '}') return ++p_, true;
            return fail("expected ',' or '}'");
        }
    }
    bool array(int depth) {
        if (depth > kMaxDepth) return fail("nesting too deep");
        ++p_;
        ws();
        if (p_ < end_ && *p_ == ']') return ++p_, true;
        for (;;) {
            ws();
            if (!value(depth)) return false;
            ws();
            if (p_ == end_) return fail("unterminated array");
            if (*p_ == ',') {
                ++p_;
                continue;
            }
            if (*p_ == ']') return ++p_, true;
            return fail("expected ',' or ']'");
        }
    }
    bool string() {
        ++p_;  // opening quote
        while (p_ < end_) {
            auto c = static_cast<unsigned char>(*p_);
            if (c == '"') return ++p_, true;
            if (c < 0x20) return fail("control character in string");
            if (c == '\\') {
                ++p_;
                if (p_ == end_) break;
                char e = *p_;
                if (e == 'u') {
                    for (int k = 0; k < 4; ++k) {
                        ++p_;
                        if (p_ == end_ || !hex(*p_)) return fail("invalid \\u escape");
                    }
                } else if (e != '"' && e != '\\' && e != '/' && e != 'b' && e != 'f' && e != 'n' && e != 'r' &&
                           e != 't') {
                    return fail("invalid escape");
                }
                ++p_;
                continue;
            }
            if (c < 0x80) {
                ++p_;
                continue;
            }
            if (!utf8()) return false;
        }
        return fail("unterminated string");
    }
    // One multi-byte UTF-8 sequence (RFC 3629: no overlongs, no surrogates, at most U+10FFFF).
    bool utf8() {
        auto c = static_cast<unsigned char>(*p_);
        int n;
        unsigned lo = 0x80, hi = 0xBF;
        if (c >= 0xC2 && c <= 0xDF) {
            n = 1;
        } else if (c >= 0xE0 && c <= 0xEF) {
            n = 2;
            if (c == 0xE0) lo = 0xA0;
            if (c == 0xED) hi = 0x9F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            n = 3;
            if (c == 0xF0) lo = 0x90;
            if (c == 0xF4) hi = 0x8F;
        } else {
            return fail("invalid UTF-8");
        }
        ++p_;
        for (int k = 0; k < n; ++k, ++p_) {
            if (p_ == end_) return fail("invalid UTF-8");
            auto b = static_cast<unsigned char>(*p_);
            if (b < lo || b > hi) return fail("invalid UTF-8");
            lo = 0x80, hi = 0xBF;
        }
        return true;
    }
    bool number() {
        if (p_ < end_ && *p_ == '-') ++p_;
        if (p_ == end_) return fail("invalid value");
        if (*p_ == '0') {
            ++p_;
        } else if (digit(*p_)) {
            while (p_ < end_ && digit(*p_))
                ++p_;
        } else {
            return fail("invalid value");
        }
        if (p_ < end_ && *p_ == '.') {
            ++p_;
            if (p_ == end_ || !digit(*p_)) return fail("invalid number");
            while (p_ < end_ && digit(*p_))
                ++p_;
        }
        if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
            ++p_;
            if (p_ < end_ && (*p_ == '+' || *p_ == '-')) ++p_;
            if (p_ == end_ || !digit(*p_)) return fail("invalid number");
            while (p_ < end_ && digit(*p_))
                ++p_;
        }
        return true;
    }

    const char* p_;
    const char* end_;
    const char* begin_;
    std::string err_;
};

}  // namespace

bool json_valid(const char* data, size_t size, std::string* why, size_t* column) {
    return Checker(data, size).run(why, column);
}

}  // namespace smstore
