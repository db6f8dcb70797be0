// Helpers of the elastic-group tests (elastic_test.cc, elastic_fault_test.cc): communicator
// creation with elastic options, polling with deadlines, deterministic int64 inputs, and the
// checks of every collective over the active slots against a local reference.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/pg/pg_harness.h"

namespace mooncake::pg::test {

struct Mode {
  bool auto_deactivate = true;
  bool auto_sync = true;
};

inline std::unique_ptr<Communicator> elasticComm(RankEnv& env, int slot, int size, int max,
                                                 bool extension, Mode m = {},
                                                 const std::string& name = "",
                                                 std::function<void(const char*)> hook = {}) {
  CommOptions co;
  co.rank = slot;
  co.size = size;
  co.group_name = env.group + name;
  co.timeout = std::chrono::seconds(60);
  co.elastic.enabled = true;
  co.elastic.max_group_size = max;
  co.elastic.is_extension = extension;
  co.elastic.auto_deactivate_on_failure = m.auto_deactivate;
  co.elastic.auto_sync_on_failure = m.auto_sync;
  co.elastic.test_hook = std::move(hook);
  return Communicator::create(env.engine, env.rdv, co);
}

// Polls pred every millisecond until it holds or `s` seconds passed; returns whether it held.
inline bool waitFor(const std::function<bool()>& pred, double s) {
  auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(int64_t(s * 1e6));
  while (!pred()) {
    if (std::chrono::steady_clock::now() > until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return true;
}

inline std::vector<int> activeSlots(const Communicator& c) {
  std::vector<int> out;
  auto m = c.activeMask();
  for (size_t s = 0; s < m.size(); ++s)
    if (m[s]) out.push_back(static_cast<int>(s));
  return out;
}

// Every process arrives at barrier `id` (a shared counter per id) and waits for `n`.
inline void arrive(Shared* sh, int id, int n, double s = 60) {
  sh->more[id].fetch_add(1);
  EXPECT_TRUE(waitFor([&] { return sh->more[id].load() >= n; }, s)) << "barrier " << id;
}

inline int64_t val(int slot, size_t i, int64_t salt) {
  return (slot + 1) * 1000003 + static_cast<int64_t>(i) * 7 + salt * 131;
}
inline std::vector<int64_t> input(int slot, size_t n, int64_t salt) {
  std::vector<int64_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = val(slot, i, salt);
  return v;
}

// Runs every collective and a p2p exchange over the group's current active slots and checks
// them against the reference (int64 sums are exact). Holes (inactive slots below size()) must
// come back zero-filled. salt makes every call's data distinct.
inline void checkCollectives(Communicator& c, int64_t salt, size_t n = 1000) {
  const int me = c.rank(), size = c.size();
  const std::vector<int> act = activeSlots(c);
  auto active = [&](int s) { return std::find(act.begin(), act.end(), s) != act.end(); };
  // allreduce (small and two-phase sizes)
  for (size_t count : {n, size_t(1) << 17}) {
    std::vector<int64_t> buf = input(me, count, salt);
    c.allReduce(buf.data(), buf.data(), count, DataType::kInt64, ReduceOp::kSum);
    for (size_t i = 0; i < count; i += 97) {
      int64_t want = 0;
      for (int s : act) want += val(s, i, salt);
      ASSERT_EQ(buf[i], want) << "allreduce count " << count << " at " << i;
    }
  }
  // allgather: size blocks, holes zero
  {
    std::vector<int64_t> in = input(me, n, salt + 1), out(size * n, -1);
    c.allGather(in.data(), out.data(), n * 8);
    for (int s = 0; s < size; ++s)
      for (size_t i = 0; i < n; i += 31)
        ASSERT_EQ(out[s * n + i], active(s) ? val(s, i, salt + 1) : 0)
            << "allgather block " << s << " at " << i;
  }
  // reduce_scatter: input has size blocks; this slot gets block `me` summed over the actives
  {
    std::vector<int64_t> in(size * n), out(n, -1);
    for (int b = 0; b < size; ++b)
      for (size_t i = 0; i < n; ++i) in[b * n + i] = val(me, i + b * n, salt + 2);
    c.reduceScatter(in.data(), out.data(), n, DataType::kInt64, ReduceOp::kSum);
    for (size_t i = 0; i < n; i += 13) {
      int64_t want = 0;
      for (int s : act) want += val(s, i + me * n, salt + 2);
      ASSERT_EQ(out[i], want) << "reduce_scatter at " << i;
    }
  }
  // broadcast from the lowest and the highest active slot
  for (int root : {act.front(), act.back()}) {
    std::vector<int64_t> buf = me == root ? input(root, n, salt + 3) : std::vector<int64_t>(n, -1);
    c.broadcast(buf.data(), n * 8, root);
    for (size_t i = 0; i < n; i += 17) ASSERT_EQ(buf[i], val(root, i, salt + 3)) << "bcast";
  }
  // all-to-all: block j of slot s goes to j (holes: nothing sent, zero received)
  {
    const size_t k = 64;
    std::vector<int64_t> in(size * k), out(size * k, -1);
    std::vector<size_t> sb(size, k * 8), so(size), rb(size, k * 8), ro(size);
    for (int j = 0; j < size; ++j) {
      so[j] = ro[j] = j * k * 8;
      for (size_t i = 0; i < k; ++i) in[j * k + i] = val(me, i + j * 1000, salt + 4);
    }
    c.allToAllV(in.data(), sb, so, out.data(), rb, ro);
    for (int s = 0; s < size; ++s)
      for (size_t i = 0; i < k; i += 7)
        ASSERT_EQ(out[s * k + i], active(s) ? val(s, i + me * 1000, salt + 4) : 0)
            << "alltoall from " << s;
  }
  // gather to / scatter from the highest active slot
  {
    const int root = act.back();
    std::vector<int64_t> in = input(me, n, salt + 5), out(me == root ? size * n : 0, -1);
    c.gather(in.data(), me == root ? out.data() : nullptr, n * 8, root);
    if (me == root) {
      for (int s = 0; s < size; ++s)
        for (size_t i = 0; i < n; i += 29)
          ASSERT_EQ(out[s * n + i], active(s) ? val(s, i, salt + 5) : 0) << "gather " << s;
    }
    std::vector<int64_t> sin(me == root ? size * n : 0), sout(n, -1);
    if (me == root) {
      for (int s = 0; s < size; ++s)
        for (size_t i = 0; i < n; ++i) sin[s * n + i] = val(s, i, salt + 6);
    }
    c.scatter(me == root ? sin.data() : nullptr, sout.data(), n * 8, root);
    for (size_t i = 0; i < n; i += 23) ASSERT_EQ(sout[i], val(me, i, salt + 6)) << "scatter";
  }
  c.barrier();
  // p2p: a ring over the active slots (every slot sends to the next, receives from the previous)
  if (act.size() > 1) {
    size_t pos = std::find(act.begin(), act.end(), me) - act.begin();
    const int next = act[(pos + 1) % act.size()], prev = act[(pos + act.size() - 1) % act.size()];
    std::vector<int64_t> out = input(me, n, salt + 7), got(n, -1);
    // Errors of either side become test failures with their message (a thread left joinable
    // by an exception would terminate the process without one).
    std::string send_err;
    std::thread t([&] {
      try {
        c.send(out.data(), n * 8, next, 77);
      } catch (const std::exception& e) {
        send_err = e.what();
      }
    });
    int from = -2;
    std::string recv_err;
    try {
      from = c.recv(got.data(), n * 8, prev, 77);
    } catch (const std::exception& e) {
      recv_err = e.what();
    }
    t.join();
    ASSERT_EQ(send_err, "") << "p2p send from slot " << me << " to " << next;
    ASSERT_EQ(recv_err, "") << "p2p recv at slot " << me << " from " << prev;
    EXPECT_EQ(from, prev);
    // A send returns once the message is handed to the engine: a rank must not exit (and stop
    // its engine) before its receiver got it (as in p2p_test.cc).
    c.barrier();
    for (size_t i = 0; i < n; i += 11) ASSERT_EQ(got[i], val(prev, i, salt + 7)) << "p2p";
  }
}

}  // namespace mooncake::pg::test
