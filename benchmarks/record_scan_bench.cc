// record_scan_bench: what the rebuild scan of a segment costs (store/master/record.cc,
// scanRecords; a client runs it over its own segment when a new master asks for its records).
//
//   record_scan_bench [--segments 1G,4G] [--objects 64K,512K,2M,mix] [--reps 5] [--key 100]
//                     [--no-fresh] [--no-window] [--populate]
//
// Builds a segment as a client has one: a shared-memory file, mapped, full of committed records
// back to back (header, key, the piece's bytes: pseudo-random, so every page is backed), objects
// of the sizes given ("mix": 64 KiB to 2 MiB, uniformly among powers of two), plus an empty
// segment (never written: all holes). Then times, median of --reps runs, each variant in the
// same process and on the same memory:
//
//   before  the walk of b785c71's parent: steps over a committed record's whole allocation
//   now     scanRecords as it is: steps over header and key only (finds records inside a stale
//           committed one), reads the first word of every 64-byte line of backed memory
//
// each through the mapping that wrote the records ("warm": its page tables are filled, as when
// the owner's engine received the bytes over tcp) and through a fresh mapping of the same file
// ("fresh": every page touched faults in, as when same-host peers wrote through their own
// mappings), and through a 4 MiB host window filled by memcpy ("window": the walk used for a
// segment in GPU memory, which copies through a window). The "now" walks use the client's
// hole map (SegmentDataMap: SEEK_DATA, then mincore for a stretch's end), the "before" walks
// the SEEK_DATA/SEEK_HOLE map they had. Every variant must report the same records. --populate
// adds "now+pop/fresh": the fresh mapping prefaulted with MADV_POPULATE_READ per stretch of data
// before the walk (measured slower than letting the walk fault, on Linux 6.18 in a VM).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "benchmarks/bench_units.h"
#include "store/master/record.h"

using namespace mooncake::store;
using mooncake::bench::fmtSize;
using mooncake::bench::parseSize;
using mooncake::bench::splitComma;
using Clock = std::chrono::steady_clock;

namespace {

// The walk before b785c71 (its stepping only; decodeRecord is the same): a committed record's
// whole allocation was stepped over, an uncommitted one's 64 bytes.
template <typename At>
bool walkBefore(At&& at, uint64_t size, uint64_t tag,
                const std::function<void(uint64_t, const RecordInfo&)>& fn,
                const std::function<std::pair<uint64_t, uint64_t>(uint64_t)>& next_data) {
  const uint64_t magic = recordMagic(tag);
  const uint64_t max_rec = recordBytes(1u << 16);
  RecordInfo rec;
  uint64_t off = 0, data_end = 0;
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
    uint64_t word;
    std::memcpy(&word, p, 8);
    if (word == magic) {
      p = at(off, max_rec);
      if (p == nullptr) return false;
      if (decodeRecord(p, size - off, tag, &rec)) {
        fn(off, rec);
        if (!rec.committed) {
          off += kRecordAlign;
          continue;
        }
        uint64_t len = recordAllocBytes(rec.key.size(), rec.piece_length);
        off += (len + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
        continue;
      }
    }
    off += kRecordAlign;
  }
  return true;
}

// A window reader over `seg` as scanRecords' second form wants it (the GPU-segment walk).
struct Window {
  const char* seg;
  uint64_t size;
  std::string buf;
  uint64_t lo = 0, hi = 0;
  explicit Window(const char* s, uint64_t n, uint64_t w) : seg(s), size(n), buf(std::min(w, n), 0) {}
  const char* at(uint64_t off, uint64_t need) {
    need = std::min(need, size - off);
    if (off < lo || off + need > hi) {
      lo = off;
      hi = std::min(size, off + buf.size());
      std::memcpy(buf.data(), seg + lo, hi - lo);
    }
    return buf.data() + (off - lo);
  }
};

struct Segment {
  std::string name;
  int fd = -1;
  char* base = nullptr;
  uint64_t size = 0;
  ~Segment() {
    if (base != nullptr) munmap(base, size);
    if (fd >= 0) close(fd);
    if (!name.empty()) shm_unlink(name.c_str());
  }
  std::pair<uint64_t, uint64_t> next(uint64_t off) const {  // SEEK_HOLE, as the old walk's
    off_t d = lseek(fd, static_cast<off_t>(off), SEEK_DATA);
    if (d < 0) return {size, size};
    off_t h = lseek(fd, d, SEEK_HOLE);
    uint64_t end = h < 0 ? size : static_cast<uint64_t>(h);
    return {static_cast<uint64_t>(d), std::min(end, size)};
  }
};

bool makeSegment(uint64_t size, Segment* s) {
  s->name = "/mc-scan-bench-" + std::to_string(getpid());
  shm_unlink(s->name.c_str());
  s->fd = shm_open(s->name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (s->fd < 0 || ftruncate(s->fd, static_cast<off_t>(size)) != 0) return false;
  void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd, 0);
  if (p == MAP_FAILED) return false;
  s->base = static_cast<char*>(p);
  s->size = size;
  return true;
}

// Fills the segment with committed records back to back; returns how many.
uint64_t fill(Segment& s, const std::string& objects, size_t key_len, uint64_t tag) {
  std::mt19937_64 rng(12345);
  const std::vector<uint64_t> mix = {64u << 10, 128u << 10, 256u << 10, 512u << 10, 1u << 20,
                                     2u << 20};
  uint64_t off = 0, n = 0, x = 0x9e3779b97f4a7c15ull;
  while (true) {
    const uint64_t len = objects == "mix" ? mix[rng() % mix.size()] : parseSize(objects);
    RecordInfo r;
    char k[32];
    std::snprintf(k, sizeof(k), "%llu-", static_cast<unsigned long long>(n));
    r.key = std::string(k) + std::string(key_len > strlen(k) ? key_len - strlen(k) : 0, 'k');
    r.put_id = n + 1;
    r.object_size = r.piece_length = len;
    const uint64_t rb = recordBytes(r.key.size());
    const uint64_t alloc = (rb + len + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
    if (off + alloc > s.size) break;
    encodeRecord(r, tag, s.base + off);
    std::memcpy(s.base + off + kRecordCommitOffset, &r.put_id, 8);
    uint64_t* w = reinterpret_cast<uint64_t*>(s.base + off + rb);
    for (uint64_t i = 0; i < len / 8; ++i) {  // xorshift: bytes that are no record
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;
      w[i] = x;
    }
    off += alloc;
    ++n;
  }
  return n;
}

struct Variant {
  std::string name;
  std::function<uint64_t()> run;  // returns the records found
  std::vector<double> ms;
  uint64_t found = 0;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void bench(uint64_t size, const std::string& objects, int reps, size_t key_len, bool fresh,
           bool window, bool populate) {
  Segment s;
  if (!makeSegment(size, &s)) {
    std::fprintf(stderr, "cannot make a %s shm segment\n", fmtSize(size).c_str());
    return;
  }
  const uint64_t tag = 0x5eed5eed12345678ull;
  auto t0 = Clock::now();
  const uint64_t n = objects == "empty" ? 0 : fill(s, objects, key_len, tag);
  const double fill_s = std::chrono::duration<double>(Clock::now() - t0).count();
  auto next = [&s](uint64_t off) { return s.next(off); };
  auto count = [](uint64_t* c) { return [c](uint64_t, const RecordInfo&) { ++*c; }; };

  std::vector<Variant> vs;
  auto direct = [&](const std::string& name, bool before, bool fresh_map, bool populate = false) {
    vs.push_back({name, [&, before, fresh_map, populate]() -> uint64_t {
                    const char* base = s.base;
                    void* m = nullptr;
                    if (fresh_map) {
                      m = mmap(nullptr, s.size, PROT_READ, MAP_SHARED, s.fd, 0);
                      if (m == MAP_FAILED) return 0;
                      base = static_cast<const char*>(m);
                    }
                    if (populate) {  // each stretch of data prefaulted in one call
                      for (uint64_t o = 0; o < s.size;) {
                        auto [d, e] = s.next(o);
                        if (d >= s.size) break;
                        madvise(const_cast<char*>(base) + d, e - d, 22 /* MADV_POPULATE_READ */);
                        o = e;
                      }
                    }
                    uint64_t c = 0;
                    if (before)
                      walkBefore([base](uint64_t off, uint64_t) { return base + off; }, s.size,
                                 tag, count(&c), next);
                    else {  // the client's hole map (HoleMap, store/client/client_link.cc)
                      SegmentDataMap map(s.fd, 0, base, s.size);
                      scanRecords(base, s.size, tag, count(&c),
                                  [&map](uint64_t off) { return map.next(off); });
                    }
                    if (m != nullptr) munmap(m, s.size);
                    return c;
                  }, {}, 0});
  };
  direct("before/warm", true, false);
  direct("now/warm", false, false);
  if (fresh) {
    direct("before/fresh", true, true);
    direct("now/fresh", false, true);
    if (populate) direct("now+pop/fresh", false, true, true);
  }
  if (window && n > 0) {  // (an empty segment read through a mapping would get its pages)
    vs.push_back({"before/window", [&]() -> uint64_t {
                    Window w(s.base, s.size, 4ull << 20);
                    uint64_t c = 0;
                    walkBefore([&w](uint64_t off, uint64_t need) { return w.at(off, need); },
                               s.size, tag, count(&c), nullptr);
                    return c;
                  }, {}, 0});
    vs.push_back({"now/window", [&]() -> uint64_t {
                    uint64_t c = 0;
                    scanRecords(
                        [&](uint64_t off, uint64_t len, char* out) {
                          std::memcpy(out, s.base + off, len);
                          return true;
                        },
                        s.size, tag, count(&c));
                    return c;
                  }, {}, 0});
  }
  for (int r = 0; r < reps; ++r) {
    for (Variant& v : vs) {
      auto a = Clock::now();
      v.found = v.run();
      v.ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - a).count());
    }
  }
  std::printf("segment %s, objects %s, key %zu B: %llu records (filled in %.1f s)\n",
              fmtSize(size).c_str(), objects.c_str(), key_len, static_cast<unsigned long long>(n),
              fill_s);
  for (Variant& v : vs) {
    const double med = median(v.ms);
    std::printf("  %-14s median %9.2f ms  (min %9.2f, max %9.2f)  %7.3f s/GiB  found %llu%s\n",
                v.name.c_str(), med, *std::min_element(v.ms.begin(), v.ms.end()),
                *std::max_element(v.ms.begin(), v.ms.end()),
                med / 1000.0 / (static_cast<double>(size) / (1ull << 30)),
                static_cast<unsigned long long>(v.found),
                v.found == n ? "" : "  MISMATCH");
  }
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  std::string segments = "1G,4G", objects = "64K,512K,2M,mix";
  int reps = 5;
  size_t key_len = 100;
  bool fresh = true, window = true, populate = false;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto val = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--segments") segments = val();
    else if (a == "--objects") objects = val();
    else if (a == "--reps") reps = std::max(1, std::stoi(val()));
    else if (a == "--key") key_len = static_cast<size_t>(std::stoul(val()));
    else if (a == "--no-fresh") fresh = false;
    else if (a == "--no-window") window = false;
    else if (a == "--populate") populate = true;
    else {
      std::fprintf(stderr,
                   "usage: %s [--segments 1G,4G] [--objects 64K,512K,2M,mix] [--reps 5] "
                   "[--key 100] [--no-fresh] [--no-window] [--populate]\n",
                   argv[0]);
      return 2;
    }
  }
  for (const std::string& seg : splitComma(segments)) {
    bench(parseSize(seg), "empty", reps, key_len, fresh, window, populate);
    for (const std::string& obj : splitComma(objects))
      bench(parseSize(seg), obj, reps, key_len, fresh, window, populate);
  }
  return 0;
}
