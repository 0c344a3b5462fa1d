// The text-line packer: lines stream straight into the writer; jsonl also checks each whole line.
#include "text_lines.hpp"

#include "error.hpp"
#include "json_check.hpp"

namespace smstore {
namespace {

void check_json_line(const std::string& file, uint64_t line_no, const char* p, size_t n) {
    std::string why;
    size_t column = 0;
    if (!json_valid(p, n, &why, &column)) {
        throw Error(Error::Kind::Input, file + ":" + std::to_string(line_no) + ": invalid JSON: " + why + " (column " +
                                            std::to_string(column) + ")");
    }
}

}  // namespace

uint64_t pack_lines(Writer& writer, const std::vector<InputSpan>& inputs, LineFormat format, PackProgress* progress,
                    uint64_t max_line) {
    if (format == LineFormat::Lines) {
        return scan_lines(inputs, progress,
                          [&](const std::string&, uint64_t, const char* p, size_t n, bool, bool ends) {
                              writer.write_data(p, n);
                              if (ends) writer.end_record();
                          });
    }
    LineJoiner joiner(max_line);
    return scan_lines(inputs, progress,
                      [&](const std::string& file, uint64_t line_no, const char* p, size_t n, bool starts, bool ends) {
                          writer.write_data(p, n);
                          if (joiner.add(file, line_no, p, n, starts, ends)) {
                              check_json_line(file, line_no, p, n);
                              writer.end_record();
                          }
                      });
}

}  // namespace smstore
