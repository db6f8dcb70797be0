// The record in front of every piece of an object in a segment: what lets a segment's owner tell
// a new master which objects it holds after the old master died (docs/store.md, "Failover").
//
// Layout of a piece's allocation (every allocation starts at a multiple of 64 bytes):
//
//   [header: 64 bytes][key, padded to a multiple of 64][the piece's bytes]
//
// The writer writes header + key + data in one engine batch (the header says "not committed"),
// asks the master to publish the object, and once the master acknowledged it writes the put's
// id into the header's commit word: a record counts only when commit == put_id. The master
// wipes the magic of a record before the memory it sits in can be handed out again (remove,
// eviction, a revoked put), so every committed record found in a segment belongs to a live
// object (or to one removed in the instant before the master died, which then comes back).
//
// The owner finds records by walking its segment at 64-byte steps (skipping what the operating
// system never backed: nothing was ever written there) and each record's header and key, but not
// its bytes: a stale committed record (its wipe failed) may enclose newer ones.
// Readers never see records: a piece's address is that of its bytes, after the record.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

namespace mooncake::store {

constexpr uint64_t kRecordHeaderBytes = 64;
constexpr uint64_t kRecordAlign = 64;
constexpr uint64_t kRecordCommitOffset = 8;                   // the commit word, within the header
constexpr uint64_t kRecordMagicBase = 0x3152434b4e4f4f4dull;  // "MOONKCR1"

enum RecordFlags : uint8_t { kRecordSoftPin = 1, kRecordHardPin = 2 };

struct RecordInfo {
  std::string key;
  uint64_t put_id = 0;  // unique per put; every piece of every replica carries it
  uint64_t object_size = 0;
  uint64_t piece_offset = 0;  // where this piece's bytes start in the object
  uint64_t piece_length = 0;
  uint32_t replica_index = 0;
  uint8_t flags = 0;
  bool committed = false;
};

// Bytes of header + padded key (the piece's bytes start this far into the allocation).
inline uint64_t recordBytes(size_t key_length) {
  return kRecordHeaderBytes + (key_length + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
}
// Allocation size of a piece: record + bytes.
inline uint64_t recordAllocBytes(size_t key_length, uint64_t piece_length) {
  return recordBytes(key_length) + piece_length;
}
// Segments tag their records (a random value chosen when the segment is created), so that a
// record image inside some object's bytes, or left by another segment, is not taken for one.
inline uint64_t recordMagic(uint64_t segment_tag) { return kRecordMagicBase ^ segment_tag; }

// Writes header + padded key (recordBytes(key) bytes) into `out`, not committed.
void encodeRecord(const RecordInfo& r, uint64_t segment_tag, char* out);
// Reads a record at `p` with `avail` bytes after it (header, key and the piece's bytes must fit).
// False when there is no valid record there (wrong magic, checksum, or lengths).
bool decodeRecord(const char* p, uint64_t avail, uint64_t segment_tag, RecordInfo* out);

// Walks [base, base + size) for records: calls fn(offset of the record, record) for every valid
// one, committed or not, and steps over its header and key only (a record whose wipe failed or
// that was never committed may have had its memory handed out again: newer records can lie
// inside its length; the master resolves overlaps). next_data(offset), when given, returns
// [start, end): the first stretch at or after `offset` that may hold data (what lies before
// start was never written: a hole of the shared-memory file), start >= size when none; the
// walk never touches what it skips.
void scanRecords(const char* base, uint64_t size, uint64_t segment_tag,
                 const std::function<void(uint64_t, const RecordInfo&)>& fn,
                 const std::function<std::pair<uint64_t, uint64_t>(uint64_t)>& next_data = nullptr);

// The same walk over a segment the host cannot load from (GPU memory): read(off, len, out)
// copies [off, off + len) of the segment into out (false: it could not, and the walk stops
// there and returns false: what it reported is a prefix, not the segment's records). The walk
// reads through a host window of `window` bytes (at least the largest record's header and
// key), so a segment of any size costs that much host memory; `out` is always the window's
// start, and the first read fills the whole window (or the whole segment when smaller).
bool scanRecords(const std::function<bool(uint64_t, uint64_t, char*)>& read, uint64_t size,
                 uint64_t segment_tag, const std::function<void(uint64_t, const RecordInfo&)>& fn,
                 uint64_t window = 4ull << 20);

// Where a segment that maps a shared-memory file holds data, as scanRecords' next_data wants it:
// `mapped` is the segment's address, `file_offset` the offset in `fd`'s file it maps from
// (congruent modulo the page size), `size` its length; fd stays the caller's. A stretch starts
// where SEEK_DATA says (a hole is jumped over in one call) and ends at the first page mincore(2)
// does not find in memory, at most 8 MiB on. Where this process's page tables map the pages
// (the owner wrote them, or its engine did) that costs about 1 ms per GiB, where SEEK_HOLE walks
// every page of the stretch: 15-20 ms per GiB, a quarter of the walk over such a segment (2-core
// VM). Where they do not, mincore looks every page up in the file, slower than SEEK_HOLE: when
// it took over 50 ns a page (or found the first page swapped out, or failed), the stretch's end
// is SEEK_HOLE's, asked once for the whole stretch. Both are exact: the choice is speed only.
class SegmentDataMap {
 public:
  SegmentDataMap(int fd, uint64_t file_offset, const void* mapped, uint64_t size);
  std::pair<uint64_t, uint64_t> next(uint64_t off);

 private:
  int fd_;
  uint64_t file_offset_, size_;
  const char* mapped_;
  uint64_t page_;
  uint64_t known_lo_ = 0, known_hi_ = 0;  // a stretch SEEK_HOLE measured: data throughout
  unsigned char in_[2048];                // mincore's answer
};

}  // namespace mooncake::store
