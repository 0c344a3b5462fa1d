// Write side of the core: a streaming, atomic blob writer.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "format.hpp"

namespace smstore {

// Streams records into an unnamed temporary file next to `path` and publishes it with one rename
// in finish(). Until then nothing at `path` changes, and a process killed at any moment leaves no
// file that opens (the header, with its magic, is written last). Only a regular file is ever
// replaced, and the new file keeps its permission bits.
class Writer {
public:
    // Every record must be a whole number of `item_size` bytes (the itemsize of an array encoding).
    explicit Writer(std::string path, bool durable = true, uint64_t item_size = 1);
    // Writes into `fd`, an empty, writable, seekable file (e.g. a memfd) that the Writer now owns;
    // `label` names it in errors. finish_fd() hands the complete blob back instead of publishing it.
    Writer(int fd, std::string label);
    ~Writer();
    Writer(const Writer&) = delete;
    Writer& operator=(const Writer&) = delete;

    // One whole record; one that is not whole items is refused before a byte of it is written.
    void append(const void* data, size_t size) {
        check_record_size(size);
        write_data(data, size);
        close_record();
    }
    // Part of the current record; end_record() closes it. Lets records of any size stream through.
    // Inline: `smstore pack` calls it once per line, and most lines fit the buffer.
    void write_data(const void* data, size_t size) {
        if (__builtin_expect(fd_ < 0, 0)) check_open();
        put(data, size);
        data_size_ += size;
    }
    void end_record() {
        check_record_size(data_size_ - record_start_);
        close_record();
    }

    uint64_t record_count() const noexcept { return records_; }
    uint64_t data_size() const noexcept { return data_size_; }
    const std::string& path() const noexcept { return path_; }
    bool is_open() const noexcept { return fd_ >= 0; }

    // Writes index, metadata and header, then atomically renames the file into place.
    void finish(std::string_view metadata_json);
    // For a Writer(fd, label): writes index, metadata and header, and returns the fd (now the caller's).
    int finish_fd(std::string_view metadata_json);
    // Drops everything written; `path` is left as it was. Safe to call twice.
    void abort() noexcept;

private:
    void begin();  // after the fd is open: skip the header, start the index
    void check_open() const;
    void check_record_size(uint64_t size) const {
        if (__builtin_expect(item_size_ > 1, 0) && size % item_size_ != 0) reject_record_size(size);
    }
    [[noreturn]] void reject_record_size(uint64_t size) const;
    void close_record() {
        offsets_.push_back(data_size_);
        record_start_ = data_size_;
        ++records_;
        if (__builtin_expect(offsets_.size() == kIndexChunk, 0)) spill_offsets();
    }
    // The offsets index is held in RAM a chunk at a time; full chunks go to an unnamed temporary file
    // (next to the output, or a memfd for Writer(fd, label)), so memory does not grow with the number
    // of records. write_tail() copies them back after the data.
    static constexpr size_t kIndexChunk = size_t{1} << 17;  // 1 MiB of offsets
    void spill_offsets();
    void copy_spilled_offsets();
    // Through the buffer, hashed in file order.
    void put(const void* data, size_t size) {
        file_pos_ += size;
        if (size <= buf_.size() - buf_used_) {
            std::memcpy(buf_.data() + buf_used_, data, size);
            buf_used_ += size;
            return;
        }
        put_slow(data, size);
    }
    void put_slow(const void* data, size_t size);
    void flush_buffer();
    void write_all(const void* data, size_t size);
    void write_tail(std::string_view metadata_json);
    void publish();

    std::string path_;
    std::string tmp_path_;  // named temporary, only where O_TMPFILE is unavailable
    bool durable_;
    uint64_t item_size_ = 1;
    bool to_fd_ = false;  // Writer(fd, label): no path, no rename
    int fd_ = -1;
    std::vector<unsigned char> buf_;
    size_t buf_used_ = 0;
    std::vector<uint64_t> offsets_;  // the index entries not yet spilled
    int spill_fd_ = -1;              // the spilled index entries, in order
    uint64_t spilled_ = 0;           // how many
    uint64_t record_start_ = 0;      // data_size_ when the current record began
    uint64_t records_ = 0;
    uint64_t data_size_ = 0;
    uint64_t file_pos_ = 0;  // bytes after the header handed to put()
    uint64_t written_ = 0;   // bytes after the header handed to write(2)
    uint64_t synced_ = 0;    // bytes after the header whose writeback has been started
    BlobHasher hash_;
};

}  // namespace smstore
