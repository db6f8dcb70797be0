// The master's side of the one-round-trip put (slabs) and of failover (records, wipes, the
// rebuild from client reports, RPC gating by role), and the allocator operations they need
// (carve, allocateAt). Fake clock; nothing sleeps. The multi-process failover runs are in
// store_ha_test.cc.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "store/master/master_service.h"
#include "store/master/offset_allocator.h"
#include "store/master/record.h"
#include "store/proto/store.pb.h"

namespace mooncake::store {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;
constexpr uint64_t kBase = 0x7f0000000000ull;

struct FakeClock {
  std::shared_ptr<std::atomic<int64_t>> ns = std::make_shared<std::atomic<int64_t>>(1'000'000'000);
  ClockFn fn() const {
    auto p = ns;
    return [p] { return TimePoint(std::chrono::nanoseconds(p->load())); };
  }
  void advanceMs(int64_t v) { ns->fetch_add(v * 1'000'000); }
};

// Records the wipes asked for; answers "done" at once, or "started" (async) when told.
struct FakeWiper : MasterService::RecordWiper {
  bool async = false;
  std::vector<std::pair<uint64_t, uint64_t>> calls;  // address, token
  bool wipe(const std::string&, uint64_t address, uint64_t token) override {
    calls.emplace_back(address, token);
    return !async;
  }
};

// A committed record of `len` bytes for `key` at seg + at (put `id`).
void putRecord(char* seg, uint64_t tag, const std::string& key, uint64_t id, uint64_t len,
               uint64_t at) {
  RecordInfo r;
  r.key = key;
  r.put_id = id;
  r.object_size = r.piece_length = len;
  encodeRecord(r, tag, seg + at);
  std::memcpy(seg + at + kRecordCommitOffset, &id, 8);
}

TEST(OffsetAllocatorOps, CarveSplitsAUsedBlockInPlace) {
  OffsetAllocator a(1 * kMiB, 64);
  auto whole = a.allocate(256 * kKiB);
  ASSERT_TRUE(whole.valid());
  OffsetAllocator::Allocation head, mid, tail;
  ASSERT_TRUE(a.carve(whole, whole.offset + 64 * kKiB, 1000, &head, &mid, &tail));
  EXPECT_EQ(head.offset, whole.offset);
  EXPECT_EQ(head.size, 64 * kKiB);
  EXPECT_EQ(mid.offset, whole.offset + 64 * kKiB);
  EXPECT_EQ(mid.size, 1024u) << "rounded up to the granularity";
  EXPECT_EQ(tail.offset + tail.size, whole.offset + whole.size);
  EXPECT_EQ(a.usedBytes(), 256 * kKiB) << "carving frees nothing";
  EXPECT_EQ(a.liveAllocations(), 3u);
  EXPECT_TRUE(a.checkConsistency());
  EXPECT_FALSE(a.free(whole)) << "the carved allocation is gone";
  OffsetAllocator::Allocation h2, m2, t2;
  EXPECT_FALSE(a.carve(mid, mid.offset, mid.size + 64, &h2, &m2, &t2)) << "outside the block";
  EXPECT_TRUE(a.free(head));
  EXPECT_TRUE(a.free(tail));
  EXPECT_TRUE(a.free(mid));
  EXPECT_EQ(a.usedBytes(), 0u);
  EXPECT_EQ(a.freeBlocks(), 1u) << "merged back into one block";
  EXPECT_TRUE(a.checkConsistency());
}

TEST(OffsetAllocatorOps, AllocateAtReservesExactRangesInOneWalk) {
  OffsetAllocator a(1 * kMiB, 64);
  auto got = a.allocateAt({{0, 4096}, {8192, 100}, {65536, 64}, {65536 + 32, 64}});
  ASSERT_EQ(got.size(), 4u);
  EXPECT_TRUE(got[0].valid());
  EXPECT_EQ(got[0].offset, 0u);
  EXPECT_TRUE(got[1].valid());
  EXPECT_EQ(got[1].size, 128u);
  EXPECT_TRUE(got[2].valid());
  EXPECT_FALSE(got[3].valid()) << "unaligned";
  EXPECT_TRUE(a.checkConsistency());
  auto again = a.allocateAt({{4096 - 64, 128}});
  EXPECT_FALSE(again[0].valid()) << "overlaps a used range";
  // Free space around the reservations is still allocatable.
  EXPECT_TRUE(a.allocate(512 * kKiB).valid());
  EXPECT_TRUE(a.checkConsistency());
}

// A record that was never committed (a revoked put: its memory was freed without a wipe and
// handed out again) must not hide the committed records that now lie inside its length.
TEST(Records, ScanStepsIntoAnUncommittedRecord) {
  std::vector<char> seg(64 * kKiB, 0);
  const uint64_t tag = 0x77;
  RecordInfo stale;
  stale.key = "revoked";
  stale.put_id = 5;
  stale.object_size = stale.piece_length = 16 * kKiB;
  encodeRecord(stale, tag, seg.data());  // not committed
  RecordInfo live;
  live.key = "live";
  live.put_id = 9;
  live.object_size = live.piece_length = 1000;
  encodeRecord(live, tag, seg.data() + 4096);
  std::memcpy(seg.data() + 4096 + kRecordCommitOffset, &live.put_id, 8);
  std::vector<std::pair<uint64_t, bool>> found;
  scanRecords(seg.data(), seg.size(), tag,
              [&](uint64_t off, const RecordInfo& x) { found.emplace_back(off, x.committed); });
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0], std::make_pair(uint64_t{0}, false));
  EXPECT_EQ(found[1], std::make_pair(uint64_t{4096}, true)) << "inside the revoked put's length";
}

// A committed record whose wipe failed while its memory was handed out again encloses newer
// records: the scan must report them too (before, it stepped over the committed record's whole
// length and the newer object was never reported).
TEST(Records, ScanFindsNewerRecordsInsideACommittedOne) {
  std::vector<char> seg(256 * kKiB, 0);
  const uint64_t tag = 0x99;
  auto put = [&](const std::string& key, uint64_t id, uint64_t len, uint64_t at) {
    putRecord(seg.data(), tag, key, id, len, at);
  };
  put("stale", 100, 128 * kKiB, 0);
  put("newer", 200, 4096, 64 * kKiB);
  put("after", 300, 4096, 192 * kKiB);
  std::vector<std::pair<uint64_t, std::string>> found;
  scanRecords(seg.data(), seg.size(), tag,
              [&](uint64_t off, const RecordInfo& x) { found.emplace_back(off, x.key); });
  std::vector<std::pair<uint64_t, std::string>> want = {
      {0, "stale"}, {64 * kKiB, "newer"}, {192 * kKiB, "after"}};
  EXPECT_EQ(found, want);
}

// The data map of a shared-memory segment: stretches cover exactly the written pages (mincore
// ends them, SEEK_DATA jumps the holes), a record in each is found (also one whose key crosses
// the map's 8 MiB lookahead), and the walk allocates no page of a hole.
TEST(Records, SegmentDataMapCoversTheWrittenPagesOnly) {
  const std::string name = "/mc-datamap-test-" + std::to_string(getpid());
  shm_unlink(name.c_str());
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  const uint64_t size = 24 * kMiB, page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  ASSERT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
  void* m = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(m, MAP_FAILED);
  char* seg = static_cast<char*>(m);
  const uint64_t tag = 0x77;
  // Written: [0, 64 KiB), [1 MiB, 1 MiB + 8 KiB), [2 MiB, 14 MiB) (one record's key crosses
  // 10 MiB, the first lookahead's end from 2 MiB), the last page.
  auto put = [&](const std::string& key, uint64_t id, uint64_t at, uint64_t len) {
    putRecord(seg, tag, key, id, len, at);
  };
  std::memset(seg, 1, 64 * kKiB);
  std::memset(seg + 1 * kMiB, 1, 8 * kKiB);
  std::memset(seg + 2 * kMiB, 1, 12 * kMiB);
  std::memset(seg + size - page, 1, page);
  put("a", 1, 0, 4096);
  put("b", 2, 1 * kMiB, 4096);
  put(std::string(200, 'c'), 3, 10 * kMiB - 128, 4096);
  put("d", 4, 13 * kMiB, 4096);
  put("e", 5, size - page, 64);
  // Through the mapping that wrote (its page tables map the written pages), then through a
  // fresh one (none mapped: SEEK_HOLE), then one with a page in the middle of a stretch mapped.
  void* f = mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  ASSERT_NE(f, MAP_FAILED);
  const char* fresh = static_cast<const char*>(f);
  for (int pass = 0; pass < 3; ++pass) {
    const char* at = pass == 0 ? seg : fresh;
    if (pass == 2) {
      ASSERT_EQ(fresh[4 * kMiB], 1);  // maps that page (and maybe a few around it)
    }
    SegmentDataMap map(fd, 0, at, size);
    std::vector<std::pair<uint64_t, uint64_t>> stretches;
    for (uint64_t off = 0; off < size;) {
      auto [d, e] = map.next(off);
      if (d >= size) break;
      ASSERT_GE(d, off);
      ASSERT_GT(e, d);
      if (!stretches.empty() && stretches.back().second == d)
        stretches.back().second = e;
      else
        stretches.emplace_back(d, e);
      off = e;
    }
    const std::vector<std::pair<uint64_t, uint64_t>> want = {{0, 64 * kKiB},
                                                            {1 * kMiB, 1 * kMiB + 8 * kKiB},
                                                            {2 * kMiB, 14 * kMiB},
                                                            {size - page, size}};
    EXPECT_EQ(stretches, want) << "pass " << pass;
    std::vector<std::string> found;
    SegmentDataMap scan_map(fd, 0, at, size);
    scanRecords(
        at, size, tag, [&](uint64_t, const RecordInfo& x) { found.push_back(x.key.substr(0, 1)); },
        [&](uint64_t off) { return scan_map.next(off); });
    EXPECT_EQ(found, (std::vector<std::string>{"a", "b", "c", "d", "e"})) << "pass " << pass;
  }
  munmap(f, size);
  // The holes are still holes: the walk read none of them.
  EXPECT_EQ(lseek(fd, 64 * kKiB, SEEK_DATA), static_cast<off_t>(1 * kMiB));
  EXPECT_EQ(lseek(fd, 14 * kMiB, SEEK_DATA), static_cast<off_t>(size - page));
  munmap(m, size);
  close(fd);
  shm_unlink(name.c_str());
}

TEST(Records, EncodeDecodeCommitAndScan) {
  std::vector<char> seg(64 * kKiB, 0);
  RecordInfo r;
  r.key = "the-key";
  r.put_id = 42;
  r.object_size = 1000;
  r.piece_length = 1000;
  r.flags = kRecordSoftPin;
  const uint64_t tag = 0x1234;
  encodeRecord(r, tag, seg.data() + 4096);
  RecordInfo out;
  ASSERT_TRUE(decodeRecord(seg.data() + 4096, seg.size() - 4096, tag, &out));
  EXPECT_EQ(out.key, "the-key");
  EXPECT_FALSE(out.committed);
  EXPECT_FALSE(decodeRecord(seg.data() + 4096, seg.size() - 4096, tag + 1, &out)) << "other tag";
  uint64_t id = 42;
  std::memcpy(seg.data() + 4096 + kRecordCommitOffset, &id, 8);
  ASSERT_TRUE(decodeRecord(seg.data() + 4096, seg.size() - 4096, tag, &out));
  EXPECT_TRUE(out.committed);
  seg[4096 + kRecordHeaderBytes + 1] ^= 1;  // a flipped key byte: the checksum catches it
  EXPECT_FALSE(decodeRecord(seg.data() + 4096, seg.size() - 4096, tag, &out));
  seg[4096 + kRecordHeaderBytes + 1] ^= 1;
  r.key = "second";
  r.put_id = 7;
  encodeRecord(r, tag, seg.data() + 32768);
  std::vector<std::pair<uint64_t, std::string>> found;
  scanRecords(seg.data(), seg.size(), tag,
              [&](uint64_t off, const RecordInfo& x) { found.emplace_back(off, x.key); });
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].first, 4096u);
  EXPECT_EQ(found[1].second, "second");
  // A hole map that says the first 16 KiB were never written skips the first record.
  found.clear();
  scanRecords(
      seg.data(), seg.size(), tag,
      [&](uint64_t off, const RecordInfo& x) { found.emplace_back(off, x.key); },
      [&](uint64_t off) {
        return std::make_pair(std::max<uint64_t>(off, 16 * kKiB), uint64_t{seg.size()});
      });
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].second, "second");
}

// A segment the host cannot load from (GPU memory) is walked through a host window that the
// reader fills: the same records as the direct walk, with records (long keys included) across
// every window boundary, each record's header and key stepped over; a reader
// that fails ends the walk there, and the walk says so.
TEST(Records, ScanThroughAReadWindowFindsTheSame) {
  std::vector<char> seg(3 * kMiB + 4096, 0);
  const uint64_t tag = 0xfeed;
  std::mt19937_64 rng(7);
  uint64_t off = 0;
  int n = 0;
  while (true) {
    RecordInfo r;
    r.key = std::string(rng() % 3 == 0 ? 40000 + rng() % 25000 : 1 + rng() % 200,
                        static_cast<char>('a' + n % 26));
    r.put_id = 100 + n;
    r.object_size = r.piece_length = 1 + rng() % 50000;
    const uint64_t len = recordAllocBytes(r.key.size(), r.piece_length);
    if (off + len > seg.size()) break;
    encodeRecord(r, tag, seg.data() + off);
    if (n % 4 != 3) std::memcpy(seg.data() + off + kRecordCommitOffset, &r.put_id, 8);
    off += (len + kRecordAlign - 1) / kRecordAlign * kRecordAlign + kRecordAlign * (rng() % 3);
    ++n;
  }
  ASSERT_GT(n, 20);
  using Found = std::vector<std::tuple<uint64_t, std::string, bool>>;
  Found direct, windowed;
  scanRecords(seg.data(), seg.size(), tag, [&](uint64_t o, const RecordInfo& x) {
    direct.emplace_back(o, x.key, x.committed);
  });
  uint64_t reads = 0;
  auto read = [&](uint64_t o, uint64_t len, char* out) {
    EXPECT_LE(o + len, seg.size());
    std::memcpy(out, seg.data() + o, len);
    ++reads;
    return true;
  };
  EXPECT_TRUE(scanRecords(
      read, seg.size(), tag,
      [&](uint64_t o, const RecordInfo& x) { windowed.emplace_back(o, x.key, x.committed); },
      1));  // the smallest window: two of the largest record's header and key
  EXPECT_EQ(windowed, direct);
  EXPECT_GE(direct.size(), static_cast<size_t>(n));  // uncommitted ones may hide more
  EXPECT_GT(reads, 10u) << "the window did not move";
  // The reader fails past 1 MiB: the walk stops there, having reported what lay before, and
  // says it did not finish.
  windowed.clear();
  EXPECT_FALSE(scanRecords(
      [&](uint64_t o, uint64_t len, char* out) {
        if (o + len > kMiB) return false;
        std::memcpy(out, seg.data() + o, len);
        return true;
      },
      seg.size(), tag,
      [&](uint64_t o, const RecordInfo& x) { windowed.emplace_back(o, x.key, x.committed); }, 1));
  ASSERT_FALSE(windowed.empty());
  EXPECT_LT(windowed.size(), direct.size());
  EXPECT_TRUE(std::equal(windowed.begin(), windowed.end(), direct.begin()));
}

class FailoverTest : public ::testing::Test {
 protected:
  MasterConfig cfg() {
    MasterConfig c;
    c.clock = clock_.fn();
    c.record_headers = true;
    return c;
  }
  FakeClock clock_;
};

TEST_F(FailoverTest, SlabPublishIsOneCallAndCutsObjectsOut) {
  MasterService m(cfg());
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase, 16 * kMiB, 0xa).ok());
  ASSERT_TRUE(m.mountSegment("b", "sb", kBase + (1ull << 32), 16 * kMiB, 0xb).ok());
  auto slab = m.allocSlab("w", 2, 256 * kKiB, {}, 8 * kKiB);
  ASSERT_TRUE(slab.ok());
  ASSERT_EQ(slab->extents.size(), 2u);
  EXPECT_NE(slab->extents[0].client_id, slab->extents[1].client_id) << "distinct clients";
  EXPECT_NE(slab->extents[0].record_tag, 0u);
  EXPECT_EQ(m.metrics().bytes_used, 2 * 256 * kKiB);
  const uint64_t rb = recordBytes(3);
  std::vector<PublishItem> items = {{"k/1", 1000, slab->id, 0, 11},
                                    {"k/2", 5000, slab->id, 4096, 12}};
  auto res = m.publish("w", items);
  ASSERT_EQ(res.size(), 2u);
  EXPECT_EQ(res[0], ErrorCode::OK);
  EXPECT_EQ(res[1], ErrorCode::OK);
  auto rl = m.getReplicaList("k/2");
  ASSERT_TRUE(rl.ok());
  ASSERT_EQ(rl->replicas.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    EXPECT_EQ(rl->replicas[i].pieces[0].address, slab->extents[i].address + 4096 + rb)
        << "the bytes sit after the record";
  // The same range again, a range past the slab, another writer, an unknown slab.
  EXPECT_EQ(m.publish("w", {{"k/3", 100, slab->id, 0, 13}})[0], ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(m.publish("w", {{"k/3", 100, slab->id, 256 * kKiB, 13}})[0], ErrorCode::INVALID_PARAMS);
  EXPECT_EQ(m.publish("x", {{"k/3", 100, slab->id, 65536, 13}})[0], ErrorCode::ILLEGAL_CLIENT);
  EXPECT_EQ(m.publish("w", {{"k/3", 100, 999, 65536, 13}})[0], ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m.publish("w", {{"k/1", 100, slab->id, 65536, 13}})[0],
            ErrorCode::OBJECT_ALREADY_EXISTS);
  EXPECT_TRUE(m.checkInvariants());
  // Retiring returns the unpublished rest; the objects stay.
  m.retireSlabs("w", {slab->id});
  EXPECT_EQ(m.metrics().slabs, 0u);
  const uint64_t per_replica = (rb + 1000 + 63) / 64 * 64 + (rb + 5000 + 63) / 64 * 64;
  EXPECT_EQ(m.metrics().bytes_used, 2 * per_replica);
  EXPECT_TRUE(m.checkInvariants());
  EXPECT_EQ(m.remove("k/1"), ErrorCode::OK);
  EXPECT_TRUE(m.checkInvariants());
}

// A stale unfinished put of a key is taken over only by a publish that succeeds: one whose range
// is refused leaves it alone (before, it was destroyed first, and nothing replaced it).
TEST_F(FailoverTest, RefusedPublishLeavesAStalePutOfItsKeyAlone) {
  MasterService m(cfg());
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase, 16 * kMiB, 0xa).ok());
  auto slab = m.allocSlab("w", 1, 256 * kKiB, {}, 8 * kKiB);
  ASSERT_TRUE(slab.ok());
  ASSERT_EQ(m.publish("w", {{"k/1", 100, slab->id, 0, 11}})[0], ErrorCode::OK);
  ASSERT_TRUE(m.putStart("v", "k/2", 100, {}).ok());
  clock_.advanceMs(31000);  // past put_discard_timeout
  EXPECT_EQ(m.publish("w", {{"k/2", 100, slab->id, 0, 12}})[0], ErrorCode::INVALID_PARAMS)
      << "that range is published already";
  EXPECT_EQ(m.getReplicaList("k/2").error(), ErrorCode::REPLICA_IS_NOT_READY)
      << "the stale put is still there";
  EXPECT_EQ(m.metrics().put_revokes, 0u);
  EXPECT_EQ(m.publish("w", {{"k/2", 100, slab->id, 65536, 12}})[0], ErrorCode::OK);
  EXPECT_TRUE(m.getReplicaList("k/2").ok());
  EXPECT_EQ(m.metrics().put_revokes, 1u) << "taken over now";
  EXPECT_EQ(m.putEnd("v", "k/2"), ErrorCode::ILLEGAL_CLIENT) << "its old writer ends nothing";
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(FailoverTest, SlabsAreSizedToTheSegmentsAndNeverEvictForACap) {
  MasterService m(cfg());
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase, 8 * kMiB, 0xa).ok());
  ReplicateConfig one;
  ASSERT_TRUE(m.putStart("w", "old", 1000, one).ok());
  ASSERT_EQ(m.putEnd("w", "old"), ErrorCode::OK);
  // 64 MiB wanted: 1/16 of the segment granted.
  auto slab = m.allocSlab("w", 1, 64 * kMiB, {}, 8 * kKiB);
  ASSERT_TRUE(slab.ok());
  EXPECT_EQ(slab->bytes, 512 * kKiB);
  // An object larger than any slab may be: refused without evicting anyone.
  EXPECT_EQ(m.allocSlab("w", 1, 64 * kMiB, {}, 2 * kMiB).error(), ErrorCode::NO_AVAILABLE_HANDLE);
  EXPECT_EQ(m.metrics().evictions, 0u);
  EXPECT_TRUE(m.exists("old").ok());
}

TEST_F(FailoverTest, CompleteObjectsHaveTheirRecordsWipedBeforeReuse) {
  MasterService m(cfg());
  FakeWiper wiper;
  m.setRecordWiper(&wiper);
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase, 4 * kMiB, 0xa).ok());
  ReplicateConfig one;
  auto p = m.putStart("w", "k", 1000, one);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ((*p)[0].pieces[0].record_tag, 0xau);
  const uint64_t record_at = (*p)[0].pieces[0].address - recordBytes(1);
  // A put revoked before it ended never had a committed record: nothing to wipe.
  ASSERT_EQ(m.putRevoke("w", "k"), ErrorCode::OK);
  EXPECT_TRUE(wiper.calls.empty());
  p = m.putStart("w", "k", 1000, one);
  ASSERT_EQ(m.putEnd("w", "k"), ErrorCode::OK);
  wiper.async = true;
  ASSERT_EQ(m.remove("k"), ErrorCode::OK);
  ASSERT_EQ(wiper.calls.size(), 1u);
  EXPECT_EQ(wiper.calls[0].first, record_at);
  EXPECT_GT(m.metrics().bytes_used, 0u) << "held until the wipe landed";
  m.runMaintenance();
  EXPECT_GT(m.metrics().bytes_used, 0u);
  m.wipeDone(wiper.calls[0].second);
  EXPECT_EQ(m.metrics().bytes_used, 0u);
  EXPECT_TRUE(m.checkInvariants());
}

// Upserts and replica clears keep the records true: the new replicas carry record space (the
// writer commits them after upsertEnd), the replaced ones are wiped (a new master must not bring
// the old value back), a revoked upsert's were never committed, and cleared replicas are wiped.
TEST_F(FailoverTest, UpsertAndReplicaClearWipeTheRecordsTheyDrop) {
  MasterService m(cfg());
  FakeWiper wiper;
  m.setRecordWiper(&wiper);
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase, 4 * kMiB, 0xa).ok());
  ReplicateConfig one;
  auto p = m.putStart("w", "k", 1000, one);
  ASSERT_TRUE(p.ok());
  ASSERT_EQ(m.putEnd("w", "k"), ErrorCode::OK);
  const uint64_t old_record = (*p)[0].pieces[0].address - recordBytes(1);
  uint64_t id = 0;
  auto u = m.upsertStart("w", "k", 3000, one, &id);
  ASSERT_TRUE(u.ok());
  EXPECT_EQ((*u)[0].pieces[0].record_tag, 0xau) << "the upsert's writer writes records";
  const uint64_t new_record = (*u)[0].pieces[0].address - recordBytes(1);
  EXPECT_NE(new_record, old_record);
  ASSERT_EQ(m.upsertRevoke("w", "k", id), ErrorCode::OK);
  EXPECT_TRUE(wiper.calls.empty()) << "a revoked upsert committed nothing";
  u = m.upsertStart("w", "k", 3000, one, &id);
  ASSERT_TRUE(u.ok());
  const uint64_t new_record2 = (*u)[0].pieces[0].address - recordBytes(1);
  ASSERT_EQ(m.upsertEnd("w", "k", id), ErrorCode::OK);
  // The replaced value's record outlives the swap until the writer has surely committed the new
  // one (a master dying in between leaves both: the newer wins), then it is wiped.
  m.runMaintenance();
  EXPECT_TRUE(wiper.calls.empty());
  clock_.advanceMs(2100);
  m.runMaintenance();
  ASSERT_EQ(wiper.calls.size(), 1u);
  EXPECT_EQ(wiper.calls[0].first, old_record) << "the replaced value's record";
  EXPECT_EQ(m.getSize("k").value(), 3000u);
  auto cleared = m.batchReplicaClear("w", {"k"}, "sa");
  ASSERT_EQ(cleared.size(), 1u);
  ASSERT_EQ(wiper.calls.size(), 2u);
  EXPECT_EQ(wiper.calls[1].first, new_record2) << "a cleared replica's record";
  EXPECT_TRUE(m.checkInvariants());
}

ReportedPiece piece(const std::string& key, uint64_t put_id, uint64_t size, uint64_t off,
                    uint64_t len, uint32_t replica, uint64_t at) {
  return ReportedPiece{key, put_id, size, off, len, replica, 0, at};
}

TEST_F(FailoverTest, RebuildAssemblesCompleteReplicasOnly) {
  MasterService m(cfg());
  FakeWiper wiper;
  m.setRecordWiper(&wiper);
  m.beginRebuild(7, RebuildPolicy{500, 10000});
  EXPECT_EQ(m.role(), MasterRole::kRebuilding);
  m.setExpectedClients({"a", "b"});
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase, 4 * kMiB, 0xa, true).ok());
  ASSERT_TRUE(m.mountSegment("b", "sb", kBase + (1ull << 32), 4 * kMiB, 0xb, true).ok());
  // "x": two replicas, one on each. "y": one replica striped over both. "z": a replica whose
  // second piece nobody reports. "w": two puts of one key (an upsert, or a put after a remove
  // whose wipe had not landed): the newer one (larger put id) wins, though it has one replica.
  const uint64_t rx = recordBytes(1);
  std::vector<ReportedPiece> a = {
      piece("x", 1, 1000, 0, 1000, 0, 0), piece("y", 2, 3000, 0, 1000, 0, 4096),
      piece("z", 3, 2000, 0, 1000, 0, 8192), piece("w", 4, 100, 0, 100, 0, 12288),
      piece("w", 5, 100, 0, 100, 0, 16384)};
  std::vector<ReportedPiece> b = {piece("x", 1, 1000, 0, 1000, 1, 0),
                                  piece("y", 2, 3000, 1000, 2000, 0, 4096),
                                  piece("w", 4, 100, 0, 100, 1, 12288)};
  EXPECT_EQ(m.reportObjects("b", "sa", a, 0, true), ErrorCode::ILLEGAL_CLIENT)
      << "a client reports its own segment only";
  EXPECT_EQ(m.reportObjects("a", "sa", a, 2, true), ErrorCode::OK);
  EXPECT_FALSE(m.pollRebuild()) << "b has not reported";
  EXPECT_EQ(m.getReplicaList("x").error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m.reportObjects("b", "sb", b, 0, true), ErrorCode::OK);
  EXPECT_FALSE(m.pollRebuild()) << "quiet time not over";
  clock_.advanceMs(600);
  EXPECT_TRUE(m.pollRebuild());
  EXPECT_EQ(m.role(), MasterRole::kServing);
  auto x = m.getReplicaList("x");
  ASSERT_TRUE(x.ok());
  EXPECT_EQ(x->replicas.size(), 2u);
  EXPECT_EQ(x->replicas[0].pieces[0].address % (1ull << 32), rx) << "bytes after the record";
  auto y = m.getReplicaList("y");
  ASSERT_TRUE(y.ok());
  ASSERT_EQ(y->replicas.size(), 1u);
  EXPECT_EQ(y->replicas[0].pieces.size(), 2u);
  EXPECT_EQ(m.getReplicaList("z").error(), ErrorCode::OBJECT_NOT_FOUND);
  auto w = m.getReplicaList("w");
  ASSERT_TRUE(w.ok());
  ASSERT_EQ(w->replicas.size(), 1u) << "put 5 (newer, one replica) beats put 4 (two)";
  EXPECT_EQ(w->replicas[0].pieces[0].address, kBase + 16384 + rx);
  auto mt = m.metrics();
  EXPECT_EQ(mt.objects_recovered, 3u);
  EXPECT_EQ(mt.objects_revoked, 3u) << "2 unfinished puts + z";
  EXPECT_EQ(mt.rebuilds, 1u);
  // The losers' records (z's piece, both of w's put 4) were wiped.
  std::set<uint64_t> wiped;
  for (auto& [addr, token] : wiper.calls) wiped.insert(addr);
  EXPECT_TRUE(wiped.count(kBase + 8192));
  EXPECT_TRUE(wiped.count(kBase + 12288));
  EXPECT_TRUE(wiped.count(kBase + (1ull << 32) + 12288));
  EXPECT_EQ(wiped.size(), 3u);
  EXPECT_TRUE(m.checkInvariants());
  // New puts never land on the rebuilt pieces.
  ReplicateConfig two;
  two.replica_num = 2;
  for (int i = 0; i < 50; ++i) {
    auto p = m.putStart("w", "new" + std::to_string(i), 3000, two);
    ASSERT_TRUE(p.ok());
    ASSERT_EQ(m.putEnd("w", "new" + std::to_string(i)), ErrorCode::OK);
  }
  EXPECT_TRUE(m.checkInvariants());
}

// Two committed records overlap when a wipe failed (holder unreachable) and the memory of the
// removed object was handed out again: the newer put (larger id) wrote inside the older one's
// range. The rebuild keeps the newer and drops the older, whose bytes were partly overwritten,
// wiping its header so that it cannot come back at a later failover (before, the lower offset
// won: get("old") served overwritten bytes and "new" was lost).
TEST_F(FailoverTest, RebuildKeepsTheNewestOfOverlappingRecords) {
  MasterService m(cfg());
  FakeWiper wiper;
  m.setRecordWiper(&wiper);
  m.beginRebuild(42, RebuildPolicy{0, 60000});
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase, 8 * kMiB, 7, true).ok());
  // "old" at 0 (1 MiB, put 100) encloses "new" (put 200); "older" (put 50) lies inside "newer"
  // (put 300, at 4 MiB), the other way round; "alone" overlaps nothing.
  std::vector<ReportedPiece> recs = {
      piece("old", 100, kMiB, 0, kMiB, 0, 0), piece("new", 200, 4096, 0, 4096, 0, 64 * kKiB),
      piece("newer", 300, kMiB, 0, kMiB, 0, 4 * kMiB),
      piece("older", 50, 4096, 0, 4096, 0, 4 * kMiB + 128 * kKiB),
      piece("alone", 60, 4096, 0, 4096, 0, 2 * kMiB)};
  ASSERT_EQ(m.reportObjects("a", "sa", recs, 0, true), ErrorCode::OK);
  ASSERT_TRUE(m.pollRebuild());
  EXPECT_EQ(m.getReplicaList("old").error(), ErrorCode::OBJECT_NOT_FOUND);
  EXPECT_EQ(m.getReplicaList("older").error(), ErrorCode::OBJECT_NOT_FOUND);
  auto n = m.getReplicaList("new");
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(n->replicas[0].pieces[0].address, kBase + 64 * kKiB + recordBytes(3));
  EXPECT_TRUE(m.getReplicaList("newer").ok());
  EXPECT_TRUE(m.getReplicaList("alone").ok());
  // "old"'s header (outside "new"'s range) is wiped; "older"'s lies inside "newer"'s bytes,
  // which overwrote it (nothing to wipe there).
  std::set<uint64_t> wiped;
  for (auto& [addr, token] : wiper.calls) wiped.insert(addr);
  EXPECT_EQ(wiped, std::set<uint64_t>{kBase});
  EXPECT_EQ(m.metrics().objects_recovered, 3u);
  EXPECT_TRUE(m.checkInvariants());
  // The dropped ranges are free again: puts fill the segment around the live objects.
  for (int i = 0; i < 40; ++i)
    ASSERT_TRUE(m.putStart("a", "fill" + std::to_string(i), 64 * kKiB, {}).ok()) << i;
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(FailoverTest, RebuildEndsAtItsTimeoutWithoutMissingClients) {
  MasterService m(cfg());
  m.beginRebuild(8, RebuildPolicy{100, 2000});
  m.setExpectedClients({"gone"});
  clock_.advanceMs(1000);
  EXPECT_FALSE(m.pollRebuild()) << "waits for the member";
  clock_.advanceMs(1100);
  EXPECT_TRUE(m.pollRebuild());
}

// A report that broke off is sent again from the start after a retried mount (the master drops
// what the first one staged: duplicates would break the tiling and revoke the object), and a
// segment whose report has not ended when the rebuild does takes no new object.
TEST_F(FailoverTest, ReportsRestartAndUnreportedSegmentsTakeNothing) {
  MasterService m(cfg());
  FakeWiper wiper;
  m.setRecordWiper(&wiper);
  m.beginRebuild(10, RebuildPolicy{100, 2000});
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase, 4 * kMiB, 0xa, true).ok());
  ASSERT_TRUE(m.mountSegment("b", "sb", kBase + (1ull << 32), 4 * kMiB, 0xb, true).ok());
  std::vector<ReportedPiece> x = {piece("x", 1, 1000, 0, 600, 0, 0),
                                  piece("x", 1, 1000, 600, 400, 0, 4096)};
  EXPECT_EQ(m.reportObjects("a", "sa", {x[0]}, 0, false), ErrorCode::OK);  // then it broke off
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase, 4 * kMiB, 0xa, true).ok());  // the retry
  EXPECT_EQ(m.reportObjects("a", "sa", x, 0, true), ErrorCode::OK);
  clock_.advanceMs(2100);  // b never reports: the rebuild ends at its timeout
  EXPECT_TRUE(m.pollRebuild());
  auto got = m.getReplicaList("x");
  ASSERT_TRUE(got.ok()) << "the re-sent report's pieces tile x once";
  EXPECT_EQ(got->replicas.size(), 1u);
  EXPECT_TRUE(wiper.calls.empty());
  ReplicateConfig one;
  for (int i = 0; i < 20; ++i) {
    auto p = m.putStart("a", "n" + std::to_string(i), 4096, one);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ((*p)[0].pieces[0].segment_name, "sa") << "sb has unreported records";
  }
  EXPECT_EQ(m.reportObjects("b", "sb", {}, 0, true), ErrorCode::OK);  // late, complete
  bool used_b = false;
  for (int i = 0; i < 20; ++i) {
    auto p = m.putStart("a", "m" + std::to_string(i), 4096, one);
    ASSERT_TRUE(p.ok());
    used_b = used_b || (*p)[0].pieces[0].segment_name == "sb";
  }
  EXPECT_TRUE(used_b) << "its report ended: it takes objects again";
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(FailoverTest, LateReportsAddWhatDoesNotConflict) {
  MasterService m(cfg());
  m.beginRebuild(9, RebuildPolicy{100, 1000});
  clock_.advanceMs(200);
  ASSERT_TRUE(m.pollRebuild());
  ASSERT_TRUE(m.mountSegment("b", "sb", kBase, 4 * kMiB, 0xb).ok());
  ReplicateConfig one;
  ASSERT_TRUE(m.putStart("b", "taken", 100, one).ok());
  ASSERT_EQ(m.putEnd("b", "taken"), ErrorCode::OK);
  ASSERT_TRUE(m.mountSegment("a", "sa", kBase + (1ull << 32), 4 * kMiB, 0xa, true).ok());
  // While a's report is under way its segment takes no new object.
  for (int i = 0; i < 20; ++i) {
    auto p = m.putStart("b", "n" + std::to_string(i), 100, one);
    ASSERT_TRUE(p.ok());
    EXPECT_EQ((*p)[0].pieces[0].segment_name, "sb");
  }
  EXPECT_EQ(
      m.reportObjects(
          "a", "sa", {piece("kept", 1, 100, 0, 100, 0, 0), piece("taken", 2, 100, 0, 100, 0, 4096)},
          0, true),
      ErrorCode::OK);
  EXPECT_TRUE(m.getReplicaList("kept").ok());
  auto t = m.getReplicaList("taken");
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->replicas[0].pieces[0].segment_name, "sb") << "the object it had stays";
  EXPECT_TRUE(m.checkInvariants());
}

TEST_F(FailoverTest, CallsAreGatedByRole) {
  MasterService m(cfg());
  proto::RequestEnvelope env;
  env.set_rpc_id(1);
  env.set_method(proto::GET_SIZE);
  proto::GetSizeRequest gs;
  gs.set_key("k");
  gs.SerializeToString(env.mutable_body());
  auto send = [&](proto::Method method) {
    env.set_method(method);
    proto::ResponseEnvelope r;
    EXPECT_TRUE(r.ParseFromString(m.handle(env.SerializeAsString())));
    return r;
  };
  m.becomeStandby();
  EXPECT_EQ(send(proto::GET_SIZE).error_code(), toInt(ErrorCode::UNAVAILABLE_IN_CURRENT_MODE));
  EXPECT_EQ(send(proto::HEARTBEAT).error_code(), toInt(ErrorCode::UNAVAILABLE_IN_CURRENT_MODE));
  m.beginRebuild(12, RebuildPolicy{100, 1000});
  auto r = send(proto::GET_SIZE);
  EXPECT_EQ(r.error_code(), toInt(ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS));
  EXPECT_EQ(r.epoch(), 12u);
  EXPECT_NE(send(proto::HEARTBEAT).error_code(), toInt(ErrorCode::UNAVAILABLE_IN_CURRENT_STATUS))
      << "registration is served while rebuilding";
  clock_.advanceMs(200);
  ASSERT_TRUE(m.pollRebuild());
  r = send(proto::GET_SIZE);
  EXPECT_EQ(r.error_code(), 0);
  EXPECT_EQ(r.epoch(), 12u);
}

}  // namespace
}  // namespace mooncake::store
