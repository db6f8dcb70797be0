#include "pg/consensus.h"

#include <algorithm>
#include <random>
#include <thread>

#include "engine/wire.h"

namespace mooncake::pg {

namespace {
// Ballots compare as (round, id).
bool less(uint64_t r1, uint64_t i1, uint64_t r2, uint64_t i2) {
  return r1 < r2 || (r1 == r2 && i1 < i2);
}
}  // namespace

std::string ViewLog::Block::serialize() const {
  wire::Writer w;
  w.u32(1);
  w.u64(mbal_round);
  w.u64(mbal_id);
  w.u64(bal_round);
  w.u64(bal_id);
  w.str(val);
  return w.take();
}

bool ViewLog::Block::parse(const std::string& s, Block* out) {
  wire::Reader r(s);
  if (r.u32() != 1) return false;
  Block b;
  b.mbal_round = r.u64();
  b.mbal_id = r.u64();
  b.bal_round = r.u64();
  b.bal_id = r.u64();
  b.val = r.str(64u << 20);
  if (!r.done()) return false;
  *out = std::move(b);
  return true;
}

ViewLog::ViewLog(std::shared_ptr<engine::Rendezvous> rdv, std::string prefix, uint64_t id)
    : rdv_(std::move(rdv)), prefix_(std::move(prefix)), id_(id) {}

std::string ViewLog::key(const char* what, uint64_t epoch) const {
  return prefix_ + "/" + what + "/" + std::to_string(epoch);
}

Result<std::optional<std::string>> ViewLog::decided(uint64_t epoch) {
  auto v = rdv_->get(key("d", epoch));
  if (v.ok()) return std::optional<std::string>(std::move(v).value());
  if (v.status().code() == Code::kNotFound) return std::optional<std::string>();
  return v.status();
}

Status ViewLog::writeBlock(uint64_t epoch, const Block& b) {
  return rdv_->set(key("b", epoch) + "/" + std::to_string(id_), b.serialize());
}

Result<std::vector<ViewLog::Block>> ViewLog::readBlocks(uint64_t epoch) {
  auto n = rdv_->add(key("n", epoch), 0);
  if (!n.ok()) return n.status();
  std::vector<Block> out;
  for (int64_t i = 1; i <= *n; ++i) {
    auto who = rdv_->get(key("r", epoch) + "/" + std::to_string(i));
    if (!who.ok()) {
      // Registered (add) but its id is not written yet: it has written no block either.
      if (who.status().code() == Code::kNotFound) continue;
      return who.status();
    }
    auto blob = rdv_->get(key("b", epoch) + "/" + *who);
    if (!blob.ok()) {
      if (blob.status().code() == Code::kNotFound) continue;
      return blob.status();
    }
    Block b;
    if (!Block::parse(*blob, &b))
      return MC_STATUS(kProtocol, "malformed consensus block of proposer " << *who);
    out.push_back(std::move(b));
  }
  return out;
}

Result<std::string> ViewLog::propose(uint64_t epoch, const std::string& value,
                                     engine::Deadline deadline) {
  std::lock_guard<std::mutex> g(mu_);
  {
    auto d = decided(epoch);
    if (!d.ok()) return d.status();
    if (d->has_value()) return std::move(**d);
  }
  if (registered_ != epoch) {
    // Registration first, the block in phase 1: a reader that finds an id without a block
    // skips it, which is safe (that proposer accepted nothing yet, and its own reads, after
    // its block write, will see the reader's block).
    mine_ = Block{};
    auto i = rdv_->add(key("n", epoch), 1);
    if (!i.ok()) return i.status();
    MC_RETURN_IF_ERROR(rdv_->set(key("r", epoch) + "/" + std::to_string(*i), std::to_string(id_)));
    registered_ = epoch;
  }
  std::minstd_rand rng(static_cast<uint32_t>(id_ * 2654435761u + epoch));
  uint64_t round = mine_.mbal_round + 1;
  for (;;) {
    if (engine::Clock::now() >= deadline)
      return MC_STATUS(kTimeout, "no view was agreed for epoch " << epoch << " in time");
    // ---- phase 1 ----
    mine_.mbal_round = round;
    mine_.mbal_id = id_;
    MC_RETURN_IF_ERROR(writeBlock(epoch, mine_));
    if (on_point) on_point("phase1");
    auto blocks = readBlocks(epoch);
    if (!blocks.ok()) return blocks.status();
    bool preempted = false;
    const Block* best = nullptr;  // the highest accepted ballot
    uint64_t top = round;
    for (const Block& b : *blocks) {
      if (less(round, id_, b.mbal_round, b.mbal_id)) {
        preempted = true;
        top = std::max(top, b.mbal_round);
      }
      if (b.bal_round > 0 && (best == nullptr || less(best->bal_round, best->bal_id,
                                                      b.bal_round, b.bal_id)))
        best = &b;
    }
    if (!preempted) {
      std::string v = best != nullptr ? best->val : value;
      // ---- phase 2 ----
      mine_.bal_round = round;
      mine_.bal_id = id_;
      mine_.val = v;
      MC_RETURN_IF_ERROR(writeBlock(epoch, mine_));
      if (on_point) on_point("phase2");
      auto again = readBlocks(epoch);
      if (!again.ok()) return again.status();
      for (const Block& b : *again) {
        if (less(round, id_, b.mbal_round, b.mbal_id)) {
          preempted = true;
          top = std::max(top, b.mbal_round);
        }
      }
      if (!preempted) {
        if (on_point) on_point("decided");
        MC_RETURN_IF_ERROR(rdv_->set(key("d", epoch), v));
        return v;
      }
    }
    // Pre-empted by a higher ballot: give its owner a moment to finish (it may decide, and
    // then there is nothing left to do), then try again above it.
    const auto pause = std::chrono::milliseconds(2 + rng() % 15);
    const auto until = std::min<engine::Deadline>(engine::Clock::now() + pause, deadline);
    while (engine::Clock::now() < until) {
      auto d = decided(epoch);
      if (!d.ok()) return d.status();
      if (d->has_value()) return std::move(**d);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    round = top + 1;
  }
}

}  // namespace mooncake::pg
