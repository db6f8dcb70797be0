// MessageReassembler: the receiver's reassembly of inbox fragments, fed by hand. A sender's
// part that it gave up on (its next message begins) or left behind (it is gone) is dropped,
// so the memory held stays at most one message per sender however many it abandons.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "engine/inbox.h"
#include "tests/engine/test_util.h"

namespace mooncake::engine {
namespace {

constexpr uint32_t kFrag = Inbox::kFragmentBytes;

// The fragments pushMessage would push for a message of `n` bytes (pattern `seed`).
std::vector<Inbox::Fragment> fragmentsOf(uint64_t src, uint64_t id, uint32_t channel, size_t n,
                                         uint64_t seed) {
  std::string m(n, '\0');
  test::fillPattern(m.data(), n, seed, 0);
  std::vector<Inbox::Fragment> out;
  uint32_t off = 0;
  do {
    uint32_t len = std::min<uint32_t>(kFrag, static_cast<uint32_t>(n) - off);
    out.push_back(Inbox::Fragment{src, id, channel, static_cast<uint32_t>(n), off,
                                  m.substr(off, len)});
    off += len;
  } while (off < n);
  return out;
}

// Feeds fragments [from, to); returns the bodies completed.
std::vector<std::string> feed(MessageReassembler& r, std::vector<Inbox::Fragment> fs,
                              size_t from = 0, size_t to = SIZE_MAX) {
  std::vector<std::string> done;
  for (size_t i = from; i < std::min(to, fs.size()); ++i) {
    std::string body;
    if (r.add(fs[i], &body)) done.push_back(std::move(body));
  }
  return done;
}

TEST(MessageReassemblerTest, WholeAndFragmentedMessages) {
  MessageReassembler r;
  for (size_t n : {size_t{0}, size_t{1}, size_t{kFrag}, size_t{kFrag + 1}, size_t{5 * kFrag + 3}}) {
    auto done = feed(r, fragmentsOf(1, 10 + n, 3, n, n));
    ASSERT_EQ(done.size(), 1u) << n;
    EXPECT_EQ(done[0].size(), n);
    EXPECT_EQ(test::checkPattern(done[0].data(), n, n, 0), "") << n;
    EXPECT_EQ(r.parts(), 0u);
    EXPECT_EQ(r.heldBytes(), 0u);
  }
  EXPECT_EQ(r.droppedFragments(), 0u);
}

// Each abandoned part is dropped when the sender's next multi-fragment message begins: the
// memory held never exceeds one part, and the next message is whole.
TEST(MessageReassemblerTest, AbandonedPartsDoNotAccumulate) {
  MessageReassembler r;
  const uint64_t before = MessageReassembler::processHeldBytes();
  for (uint64_t id = 1; id <= 100; ++id) {
    auto done = feed(r, fragmentsOf(7, id, 1, 64 * kFrag, id), 0, 10);  // gave up after 10
    EXPECT_TRUE(done.empty());
    EXPECT_EQ(r.parts(), 1u);
    EXPECT_EQ(r.heldBytes(), 10u * kFrag);
  }
  EXPECT_EQ(MessageReassembler::processHeldBytes() - before, 10u * kFrag);
  auto done = feed(r, fragmentsOf(7, 1000, 1, 3 * kFrag + 5, 55));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(test::checkPattern(done[0].data(), done[0].size(), 55, 0), "");
  EXPECT_EQ(r.parts(), 0u);
  EXPECT_EQ(r.heldBytes(), 0u);
  EXPECT_EQ(MessageReassembler::processHeldBytes(), before);
}

// A message id seen before (a sender's earlier attachment) starts afresh at offset 0.
TEST(MessageReassemblerTest, RepeatedIdStartsAfresh) {
  MessageReassembler r;
  EXPECT_TRUE(feed(r, fragmentsOf(7, 2, 1, 8 * kFrag, 1), 0, 4).empty());
  auto done = feed(r, fragmentsOf(7, 2, 1, 3 * kFrag, 2));
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].size(), 3u * kFrag);
  EXPECT_EQ(test::checkPattern(done[0].data(), done[0].size(), 2, 0), "");
}

// Single-fragment messages of the same sender are not ordered with its multi-fragment ones
// (pushMessage does not serialise them): they pass amid a part without disturbing it. Parts
// of different senders interleave freely.
TEST(MessageReassemblerTest, SmallMessagesAndOtherSendersAmidAPart) {
  MessageReassembler r;
  auto big1 = fragmentsOf(7, 1, 1, 4 * kFrag, 1);
  auto big2 = fragmentsOf(8, 1, 1, 4 * kFrag + 1, 2);
  std::vector<std::string> done;
  for (size_t i = 0; i < 5; ++i) {
    for (auto* fs : {&big1, &big2}) {
      if (i >= fs->size()) continue;
      auto d = feed(r, *fs, i, i + 1);
      done.insert(done.end(), d.begin(), d.end());
    }
    auto small = feed(r, fragmentsOf(7, 100 + i, 2, 10, 9));
    EXPECT_EQ(small.size(), 1u);
  }
  ASSERT_EQ(done.size(), 2u);
  EXPECT_EQ(done[0].size(), 4u * kFrag);
  EXPECT_EQ(done[1].size(), 4u * kFrag + 1);
  EXPECT_EQ(r.parts(), 0u);
}

// discardSender() (the sender is gone) drops its part; later fragments of it are dropped.
TEST(MessageReassemblerTest, GoneSenderPartDropped) {
  MessageReassembler r;
  auto fs = fragmentsOf(7, 5, 1, 6 * kFrag, 1);
  EXPECT_TRUE(feed(r, fs, 0, 3).empty());
  feed(r, fragmentsOf(8, 5, 1, 6 * kFrag, 1), 0, 2);  // another sender's part stays
  r.discardSender(7);
  r.sweep();
  EXPECT_EQ(r.parts(), 1u);
  EXPECT_EQ(r.heldBytes(), 2u * kFrag);
  EXPECT_TRUE(feed(r, fs, 3).empty()) << "the rest of a discarded part completed a message";
  EXPECT_EQ(r.droppedFragments(), 3u);
  r.discardSender(8);
  EXPECT_EQ(feed(r, fragmentsOf(9, 1, 1, 2, 1)).size(), 1u);  // add() applies it too
  EXPECT_EQ(r.parts(), 0u);
  EXPECT_EQ(r.heldBytes(), 0u);
}

// Fragments that do not continue the held part (gap, other total or channel) and first
// fragments with impossible sizes are dropped, and so is the part they hit.
TEST(MessageReassemblerTest, BadFragmentsDropped) {
  MessageReassembler r;
  auto fs = fragmentsOf(7, 1, 1, 4 * kFrag, 1);
  feed(r, fs, 0, 1);
  EXPECT_TRUE(feed(r, fs, 2, 3).empty());  // a gap
  EXPECT_EQ(r.parts(), 0u);
  EXPECT_TRUE(feed(r, fs, 3).empty());  // the rest of it
  feed(r, fs, 0, 1);
  Inbox::Fragment other = fs[1];
  other.channel = 2;
  std::string body;
  EXPECT_FALSE(r.add(other, &body));
  EXPECT_EQ(r.parts(), 0u);
  Inbox::Fragment huge{7, 2, 1, Inbox::kMaxMessageBytes + 1, 0, std::string(kFrag, 'x')};
  EXPECT_FALSE(r.add(huge, &body));
  Inbox::Fragment over{7, 3, 1, 10, 0, std::string(kFrag, 'x')};  // more data than total
  EXPECT_FALSE(r.add(over, &body));
  EXPECT_EQ(r.parts(), 0u);
  EXPECT_EQ(r.heldBytes(), 0u);
  EXPECT_GE(r.droppedFragments(), 5u);
}

}  // namespace
}  // namespace mooncake::engine
