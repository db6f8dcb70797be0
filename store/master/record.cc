#include "store/master/record.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

namespace mooncake::store {

namespace {

// Header layout (little endian, the host's: records never leave the host that wrote them in a
// form another architecture reads).
constexpr size_t kMagic = 0, kCommit = 8, kPutId = 16, kObjectSize = 24, kPieceOffset = 32,
                 kPieceLength = 40, kKeyLength = 48, kReplica = 52, kFlags = 54, kVersion = 55,
                 kChecksum = 56;
constexpr uint8_t kVersion1 = 1;
constexpr uint32_t kMaxKey = 1u << 16;

template <typename T>
T load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <typename T>
void store(char* p, T v) {
  std::memcpy(p, &v, sizeof(v));
}

// FNV-1a over the header's described fields and the key, folded to 32 bits. Not a defence
// against forgery (a job member may write anything into any segment anyway), only against
// taking stray bytes for a record; the 64-bit magic carries most of that.
uint32_t checksum(const char* header, const char* key, size_t key_len) {
  uint64_t h = 1469598103934665603ull;
  auto mix = [&](const char* p, size_t n) {
    for (size_t i = 0; i < n; ++i) h = (h ^ static_cast<uint8_t>(p[i])) * 1099511628211ull;
  };
  mix(header + kPutId, kChecksum - kPutId);
  mix(key, key_len);
  return static_cast<uint32_t>(h ^ (h >> 32));
}

}  // namespace

void encodeRecord(const RecordInfo& r, uint64_t segment_tag, char* out) {
  const uint64_t total = recordBytes(r.key.size());
  std::memset(out, 0, total);
  store<uint64_t>(out + kMagic, recordMagic(segment_tag));
  store<uint64_t>(out + kCommit, 0);
  store<uint64_t>(out + kPutId, r.put_id);
  store<uint64_t>(out + kObjectSize, r.object_size);
  store<uint64_t>(out + kPieceOffset, r.piece_offset);
  store<uint64_t>(out + kPieceLength, r.piece_length);
  store<uint32_t>(out + kKeyLength, static_cast<uint32_t>(r.key.size()));
  store<uint16_t>(out + kReplica, static_cast<uint16_t>(r.replica_index));
  store<uint8_t>(out + kFlags, r.flags);
  store<uint8_t>(out + kVersion, kVersion1);
  std::memcpy(out + kRecordHeaderBytes, r.key.data(), r.key.size());
  store<uint32_t>(out + kChecksum, checksum(out, r.key.data(), r.key.size()));
}

bool decodeRecord(const char* p, uint64_t avail, uint64_t segment_tag, RecordInfo* out) {
  if (avail < kRecordHeaderBytes || load<uint64_t>(p + kMagic) != recordMagic(segment_tag))
    return false;
  if (load<uint8_t>(p + kVersion) != kVersion1) return false;
  const uint32_t key_len = load<uint32_t>(p + kKeyLength);
  if (key_len == 0 || key_len > kMaxKey) return false;
  const uint64_t rec = recordBytes(key_len);
  const uint64_t piece_len = load<uint64_t>(p + kPieceLength);
  const uint64_t object_size = load<uint64_t>(p + kObjectSize);
  const uint64_t piece_off = load<uint64_t>(p + kPieceOffset);
  if (rec > avail || piece_len > avail - rec || piece_len == 0 || piece_off > object_size ||
      piece_len > object_size - piece_off)
    return false;
  if (load<uint32_t>(p + kChecksum) != checksum(p, p + kRecordHeaderBytes, key_len)) return false;
  out->key.assign(p + kRecordHeaderBytes, key_len);
  out->put_id = load<uint64_t>(p + kPutId);
  out->object_size = object_size;
  out->piece_offset = piece_off;
  out->piece_length = piece_len;
  out->replica_index = load<uint16_t>(p + kReplica);
  out->flags = load<uint8_t>(p + kFlags);
  out->committed = out->put_id != 0 && load<uint64_t>(p + kCommit) == out->put_id;
  return true;
}

namespace {

// The walk of both scanRecords: at(off, need) returns the segment's byte `off` with at least
// min(need, size - off) bytes readable after it (nullptr: unreadable, the walk ends).
template <typename At>
bool walkRecords(At&& at, uint64_t size, uint64_t segment_tag,
                 const std::function<void(uint64_t, const RecordInfo&)>& fn,
                 const std::function<std::pair<uint64_t, uint64_t>(uint64_t)>& next_data) {
  const uint64_t magic = recordMagic(segment_tag);
  RecordInfo rec;
  uint64_t off = 0;
  // Where the current stretch of backed memory ends (re-asked when crossed).
  uint64_t data_end = 0;
  while (off + kRecordHeaderBytes <= size) {
    if (next_data && off >= data_end) {
      auto [d, end] = next_data(off);
      if (d >= size) return true;
      if (d > off) off = (d + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
      data_end = std::max(end, off + kRecordAlign);
      if (off + kRecordHeaderBytes > size) return true;
    }
    const char* p = at(off, kRecordHeaderBytes);
    if (p == nullptr) return false;
    if (load<uint64_t>(p) == magic) {
      p = at(off, recordBytes(kMaxKey));  // decodeRecord reads the header and the key
      if (p == nullptr) return false;
      if (decodeRecord(p, size - off, segment_tag, &rec)) {
        fn(off, rec);
        // Step over the header and key only, never the piece's bytes, even for a committed
        // record: one whose wipe failed (or a revoked put's) may have had its memory handed out
        // again, and newer records can lie inside its length (the master keeps the newest of
        // overlapping records). Header and key are intact (the checksum covers them), so no
        // other record starts there.
        off += recordBytes(rec.key.size());
        continue;
      }
    }
    off += kRecordAlign;
  }
  return true;
}

}  // namespace

void scanRecords(const char* base, uint64_t size, uint64_t segment_tag,
                 const std::function<void(uint64_t, const RecordInfo&)>& fn,
                 const std::function<std::pair<uint64_t, uint64_t>(uint64_t)>& next_data) {
  (void)walkRecords([base](uint64_t off, uint64_t) { return base + off; }, size, segment_tag, fn,
                    next_data);
}

bool scanRecords(const std::function<bool(uint64_t, uint64_t, char*)>& read, uint64_t size,
                 uint64_t segment_tag, const std::function<void(uint64_t, const RecordInfo&)>& fn,
                 uint64_t window) {
  window = std::max<uint64_t>(window, 2 * recordBytes(kMaxKey));
  std::string buf(std::min(window, size), '\0');
  uint64_t lo = 0, hi = 0;  // the segment's [lo, hi) is in buf
  auto at = [&](uint64_t off, uint64_t need) -> const char* {
    need = std::min(need, size - off);
    if (off < lo || off + need > hi) {
      lo = off;
      hi = std::min(size, off + buf.size());
      if (!read(lo, hi - lo, buf.data())) return nullptr;
    }
    return buf.data() + (off - lo);
  };
  return walkRecords(at, size, segment_tag, fn, nullptr);
}

SegmentDataMap::SegmentDataMap(int fd, uint64_t file_offset, const void* mapped, uint64_t size)
    : fd_(fd), file_offset_(file_offset), size_(size), mapped_(static_cast<const char*>(mapped)) {
  const long page = sysconf(_SC_PAGESIZE);
  page_ = page > 0 ? static_cast<uint64_t>(page) : 4096;
}

std::pair<uint64_t, uint64_t> SegmentDataMap::next(uint64_t off) {
  if (off >= size_) return {size_, size_};
  if (off >= known_lo_ && off < known_hi_) return {off, known_hi_};
  const off_t d = lseek(fd_, static_cast<off_t>(file_offset_ + off), SEEK_DATA);
  if (d < 0 || static_cast<uint64_t>(d) < file_offset_) return {size_, size_};
  const uint64_t start = static_cast<uint64_t>(d) - file_offset_;
  if (start >= size_) return {size_, size_};
  constexpr uint64_t kLook = 8ull << 20;  // bytes asked of mincore at a time
  const uint64_t base = reinterpret_cast<uint64_t>(mapped_);
  const uint64_t first = (base + start) / page_;
  const uint64_t pages = std::min<uint64_t>(
      (base + std::min(size_, start + kLook) + page_ - 1) / page_ - first, sizeof(in_));
  const auto t0 = std::chrono::steady_clock::now();
  if (mincore(reinterpret_cast<void*>(first * page_), pages * page_, in_) == 0) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                        std::chrono::steady_clock::now() - t0)
                        .count();
    uint64_t run = 0;
    while (run < pages && (in_[run] & 1) != 0) ++run;
    // Fast: the page tables map these pages. Slow (they do not: every page is looked up in the
    // file): SEEK_HOLE walks the file's pages faster, and once for the whole stretch.
    if (run > 0 && static_cast<uint64_t>(ns) < 50 * pages)
      return {start, std::min((first + run) * page_ - base, size_)};
  }
  const off_t h = lseek(fd_, d, SEEK_HOLE);
  const uint64_t end = h < 0 ? file_offset_ + size_ : static_cast<uint64_t>(h);
  known_lo_ = start;
  known_hi_ = std::min(end - file_offset_, size_);
  return {start, known_hi_};
}

}  // namespace mooncake::store
