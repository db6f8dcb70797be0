// Stream-ordered low-latency calls on a GPU buffer (ep/buffer.h, "stream-ordered low-latency
// calls"): a call queues its kernels on the buffer's own stream behind an event of the
// caller's stream and returns; the stream copies the call's outcome words into host memory,
// and the first checkStreamCalls() after they arrived reports them. No host thread waits for
// a peer or for the kernels (DeepEP's model), except where a call needs more scratch than any
// before it (deviceScratch) or every report slot is in use.
#include <algorithm>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "engine/device/device.h"
#include "engine/log.h"
#include "engine/params.h"
#include "ep/buffer.h"
#include "ep/str.h"

namespace mooncake::ep {

namespace dev = engine::device;

namespace {

constexpr int kReportSlots = 64;  // calls whose outcome is queued but not yet reported

void check(const Status& st, const char* op, int rank, const char* what) {
  if (!st.ok())
    throw std::runtime_error(str(op, ": rank ", rank, ": ", what, ": ", st.toString()));
}

}  // namespace

// A queued part of a call: its event (after its kernels and, for a receive, the copy of its
// outcome into report slot `slot`), the caller's tensors it holds, what to report.
struct EpBuffer::StreamReport {
  std::shared_ptr<dev::Event> after;
  std::shared_ptr<void> keep;
  int slot = -1;  // -1: a send part (nothing to report)
  const char* op = "";
  uint32_t round = 0;
  int64_t max_tokens = 0;  // (for the error's words)
};

std::string EpBuffer::setUpStream() {
  dev::Device* layer = deviceLayer("ep.Buffer");
  const std::string mode = params::getString("MC_EP_STREAM_CALLS");
  const bool on = mode == "1" || mode == "on" || mode == "true";
  const bool off = mode == "0" || mode == "off" || mode == "false";
  stream_calls_ = on || (!off && std::string(layer->name()) == "cuda");
  auto s = layer->newStream(device_);
  if (!s.ok()) return str("a stream for the kernels: ", s.status().toString());
  stream_ = *s;
  if (!stream_calls_) return "";
  const size_t words = static_cast<size_t>(g_.size) + 2;
  auto report = layer->allocHostWords(words * kReportSlots);
  if (!report.ok()) return str("host words for the calls' outcomes: ", report.status().toString());
  auto zeros = layer->allocHostWords(words);
  if (!zeros.ok()) return str("host words for the calls' outcomes: ", zeros.status().toString());
  report_words_ = *report;
  zero_words_ = *zeros;
  // The rounds' words (ep/kernels/device_rounds.h), zeroed: the first round taken is 1.
  auto rounds = layer->allocate(kern::kDeviceRoundWords * 4, device_);
  if (!rounds.ok()) return str("the rounds' words: ", rounds.status().toString());
  dev_rounds_ = static_cast<uint32_t*>(*rounds);
  const uint32_t zero[kern::kDeviceRoundWords] = {};
  Status st = dev::copy(dev_rounds_, zero, sizeof zero, engine::deadlineInMs(timeout_ms_));
  if (!st.ok()) return str("zeroing the rounds' words: ", st.toString());
  free_reports_.clear();
  for (int i = kReportSlots - 1; i >= 0; --i) free_reports_.push_back(i);
  return "";
}

bool EpBuffer::freeStream() {
  if (stream_ == nullptr) return true;
  dev::Device* layer = deviceLayer("ep.Buffer");
  // The kernels of calls nobody waited for end by their own deadlines (timeout_us, dead
  // peers); a stream still busy after this bound keeps the buffer's memory.
  auto ev = layer->recordOn(device_, stream_);
  Status st = ev.ok() ? (*ev)->wait(engine::deadlineInMs(timeout_ms_)) : ev.status();
  if (!st.ok()) {
    MC_LOG(WARN, EP) << "ep buffer rank " << g_.rank << ": its kernels did not run out ("
                     << st.toString() << "); its GPU memory and the calls' tensors are left "
                     << "allocated";
    std::lock_guard<std::mutex> g(stream_mu_);
    new std::deque<std::shared_ptr<StreamReport>>(std::move(reports_));  // (never freed)
    new std::vector<std::shared_ptr<void>>(std::move(graph_keep_));      // (nor these)
    return false;
  }
  try {
    checkStreamCalls();
  } catch (const std::exception& e) {  // nobody called again to see it
    MC_LOG(WARN, EP) << "ep buffer rank " << g_.rank << " freed with an unreported failure: "
                     << e.what();
  }
  (void)layer->freeStream(device_, stream_);
  stream_ = nullptr;
  return true;
}

void EpBuffer::streamWait(const void* stream, dev::Event& ev, const char* op) {
  check(deviceLayer(op)->waitEvent(device_, stream, ev), op, g_.rank,
        "ordering the caller's stream after the call");
}

std::shared_ptr<dev::Event> EpBuffer::streamQueue(const char* op, RoundKind kind, uint32_t round,
                                                  StreamPart part,
                                                  const std::function<kern::LlLaunch()>& args,
                                                  int send_grid, const void* stream, bool detach,
                                                  std::shared_ptr<void> keep) {
  dev::Device* layer = deviceLayer(op);
  const int R = g_.size;
  const size_t words = static_cast<size_t>(R) + 2;
  const int k = static_cast<int>(kind), half = static_cast<int>(round & 1);
  // Reports taken off go after the lock: their tensors' release may need the GIL, which a
  // thread waiting for this lock may hold (PyHook's drop).
  std::vector<std::shared_ptr<StreamReport>> done;
  std::lock_guard<std::mutex> g(stream_mu_);
  int slot = -1;
  bool launched = false;  // a kernel of this part is on the stream
  bool reported = false;  // its report holds the slot and the tensors
  // Under CUDA-graph capture (the caller's stream captures): nothing here may wait on the
  // host or be numbered by it, and no report is made (the host never sees a replay run).
  const bool captured = layer->capturing(device_, stream);
  capturing_call_ = captured;
  try {
    if (captured && !device_rounds_)
      throw std::invalid_argument(str(op, ": rank ", g_.rank, ": a call inside a CUDA-graph "
                                      "capture needs its rounds counted on the device, which "
                                      "a group spanning hosts does not do (its host proxy "
                                      "numbers them)"));
    // At most two calls of a kind in flight (as claimHalf): a third would also share its half's
    // outcome words with the first, whose receive (a hook not yet called) would read them.
    if (part != StreamPart::kRecv) checkHalfLocked(op, kind, round);
    if (part == StreamPart::kRecv && hook_pending_[k][half] != round + 1)
      throw std::runtime_error(str(op, ": rank ", g_.rank, ": no send of round ", round,
                                   " waits for this hook"));
    // A capture holds whole calls: a replay's receive would read the round of whatever send
    // last took the slot, and an eager receive of a captured send would read what no send
    // wrote yet.
    if (part == StreamPart::kRecv && hook_captured_[k][half] != captured)
      throw std::invalid_argument(str(op, ": rank ", g_.rank, ": the hook of a send ",
                                      captured ? "made outside" : "captured inside",
                                      " a CUDA-graph capture was called ",
                                      captured ? "inside one" : "outside it",
                                      "; a capture must hold a call's send and its receive"));
    // A free report slot for a receive (every slot in use: the oldest calls are waited for).
    if (part != StreamPart::kSend && !captured) {
      while (free_reports_.empty()) {
        if (reports_.empty())  // (every slot lost to failed queueing: a broken device)
          throw std::runtime_error(str(op, ": rank ", g_.rank, ": no report slot left"));
        check(reports_.front()->after->wait(engine::noDeadline()), op, g_.rank,
              "waiting for an earlier call's kernels");
        auto r = reports_.front();
        reports_.pop_front();
        done.push_back(r);
        if (r->slot < 0) continue;
        free_reports_.push_back(r->slot);
        // Its failure is reported by the next check: this call still queues its kernels.
        try {
          pendingFailure(*r);
        } catch (const std::exception& e) {
          if (!late_failure_)
            late_failure_ = std::current_exception();
          else  // (one is raised; the others are logged)
            MC_LOG(WARN, EP) << e.what();
        }
      }
      slot = free_reports_.back();
      free_reports_.pop_back();
    }
    kern::LlLaunch l = args();  // (the scratch may grow here: deviceScratch)
    deviceRoundsFor(l, kind, round);
    auto before = layer->recordOn(device_, stream);
    check(before.status(), op, g_.rank, "an event on the caller's stream");
    check(layer->waitEvent(device_, stream_, **before), op, g_.rank,
          "ordering the buffer's stream after the caller's");
    int32_t* outcome = streamOutcome(kind, round);  // error[2], decision[R]
    l.p.error = outcome;
    l.p.decision = outcome + 2;
    if (part != StreamPart::kRecv)
      check(layer->copyAsyncOn(outcome, zero_words_, words * 4, device_, stream_), op, g_.rank,
            "zeroing the call's outcome");
    auto launch = [&](kern::LlStage stage, int64_t grid) {
      if (grid <= 0) return;
      deviceLaunch(l, stage, static_cast<unsigned>(grid), op);  // (on stream_)
      launched = true;
    };
    const bool dispatch = kind == RoundKind::kDispatch;
    if (part != StreamPart::kRecv)  // (ranks on other hosts: the stage's wait on the stream)
      deviceSend(l, dispatch ? kern::kDispatchSend : kern::kCombineSend, kind, send_grid, op,
                 &launched);
    if (part != StreamPart::kSend) {
      if (dispatch) {
        launch(kern::kDispatchRecv, l.p.local_experts);
      } else {
        launch(kern::kCombineWait, R);
        launch(kern::kCombineToken, l.p.tokens);
      }
      if (slot >= 0)
        check(layer->copyAsyncOn(report_words_ + static_cast<size_t>(slot) * words, outcome,
                                 words * 4, device_, stream_),
              op, g_.rank, "copying the call's outcome");
    }
    auto after = layer->recordOn(device_, stream_);
    check(after.status(), op, g_.rank, "an event after the call");
    std::shared_ptr<dev::Event> ev(std::move(*after));
    if (captured) {  // its tensors stay for the graph's replays (released with the buffer)
      graph_keep_.push_back(std::move(keep));
    } else {
      auto r = std::make_shared<StreamReport>();
      r->after = ev;
      r->keep = keep;
      r->slot = slot;
      r->op = op;
      r->round = round;
      r->max_tokens = l.p.max_tokens;
      reports_.push_back(std::move(r));
    }
    reported = true;
    if (!detach)
      check(layer->waitEvent(device_, stream, *ev), op, g_.rank,
            "ordering the caller's stream after the call");
    hook_pending_[k][half] = part == StreamPart::kSend ? round + 1 : 0;
    hook_captured_[k][half] = captured && part == StreamPart::kSend;
    return ev;
  } catch (...) {
    // A receive that failed used its hook up (hook() runs once): its half is free again.
    if (part == StreamPart::kRecv && hook_pending_[k][half] == round + 1)
      hook_pending_[k][half] = 0;
    if (!launched) {
      if (slot >= 0) free_reports_.push_back(slot);
      // The round is reserved: a send that never went out is given up, so that the peers'
      // calls of the round end at once (ep/buffer.h, "Abandoned rounds").
      // (Inside a capture no round is taken: every rank refuses its call alike, and a give-up
      // queued there would be replayed.)
      if (part != StreamPart::kRecv && !captured) abandon(kind, round);
    } else if (!reported) {
      // Kernels on the stream may still use the caller's tensors and the report slot: both
      // stay taken (a failure to queue on the device, which a CUDA fault makes sticky).
      new std::shared_ptr<void>(std::move(keep));  // (never freed)
    }
    throw;
  }
}

// Throws what the report of a call whose kernels ran says, as a waited call would have.
void EpBuffer::pendingFailure(const StreamReport& r) {
  const size_t words = static_cast<size_t>(g_.size) + 2;
  const uint32_t* w = report_words_ + static_cast<size_t>(r.slot) * words;
  int32_t error[2];
  std::memcpy(error, w, 8);
  std::vector<int32_t> decision(static_cast<size_t>(g_.size));
  std::memcpy(decision.data(), w + 2, decision.size() * 4);
  const std::string op = str(r.op, " (round ", r.round, ", a stream-ordered call reported late)");
  // kSilent is written only by a wait that saw the rank active (kern::decide).
  kernelOutcome(op.c_str(), r.round, decision, std::vector<int32_t>(decision.size(), 1));
  throwKernelError(op.c_str(), error, r.max_tokens);
}

void EpBuffer::checkStreamCalls() {
  std::vector<std::shared_ptr<StreamReport>> done;  // (released after the lock: streamQueue)
  std::lock_guard<std::mutex> g(stream_mu_);
  // Inside a capture the host asks no event anything (CUDA forbids it there); the reports
  // wait until it ended.
  if (capturing_call_ && deviceLayer("ep")->capturing(device_, stream_)) return;
  if (late_failure_) std::rethrow_exception(std::exchange(late_failure_, nullptr));
  while (!reports_.empty()) {
    auto r = reports_.front();
    if (!r->after->done()) return;
    reports_.pop_front();
    done.push_back(r);
    if (r->slot < 0) continue;
    struct Free {
      EpBuffer* b;
      int slot;
      ~Free() { b->free_reports_.push_back(slot); }
    } free{this, r->slot};
    pendingFailure(*r);
  }
}

std::shared_ptr<dev::Event> EpBuffer::streamDispatch(const LowLatencyDispatchArgs& a,
                                                     uint32_t round, StreamPart part,
                                                     const void* stream, bool detach,
                                                     std::shared_ptr<void> keep) {
  return streamQueue(
      "dispatch", RoundKind::kDispatch, round, part,
      [&] { return deviceLaunchArgs(kernelArgs(a, round), a.experts, round); }, a.experts, stream,
      detach, std::move(keep));
}

std::shared_ptr<dev::Event> EpBuffer::streamCombine(const LowLatencyCombineArgs& a,
                                                    uint32_t round, StreamPart part,
                                                    const void* stream, bool detach,
                                                    std::shared_ptr<void> keep) {
  return streamQueue(
      "combine", RoundKind::kCombine, round, part,
      [&] { return deviceLaunchArgs(kernelArgs(a, round), 0, round); }, g_.size, stream, detach,
      std::move(keep));
}

void EpBuffer::dropStreamHook(const char* op, RoundKind kind, uint32_t round) {
  std::lock_guard<std::mutex> g(stream_mu_);  // (scratch_ too: deviceScratch)
  uint32_t& held = hook_pending_[static_cast<int>(kind)][round & 1];
  if (held != round + 1) return;
  held = 0;
  // What the send's kernels found (a bad expert id: kBadTopk) the receive would have
  // reported: its outcome words are copied into a report slot behind them and reported by
  // the next check, as a receive's are. (No slot free: logged instead; nothing waits here.)
  auto layer = dev::get();
  // A captured send's (its outcome words are written by replays, not by anything the host
  // could wait for), or any dropped while a capture holds the buffer's stream (a copy and an
  // event queued now would be captured, and the capture left with work not joined back).
  const bool captured = std::exchange(hook_captured_[static_cast<int>(kind)][round & 1], false);
  if (captured || (layer.ok() && (*layer)->capturing(device_, stream_))) {
    MC_LOG(WARN, EP) << op << ": rank " << g_.rank << ": the hook of round " << round
                     << " was dropped uncalled " << (captured ? "(its send was captured in a "
                     "CUDA graph)" : "inside a CUDA-graph capture") << "; what its send found "
                     << "is not reported";
    return;
  }
  if (free_reports_.empty() || !layer.ok()) {
    MC_LOG(WARN, EP) << op << ": rank " << g_.rank << ": the hook of round " << round
                     << " was dropped uncalled; what its send found is not reported";
    return;
  }
  const size_t words = static_cast<size_t>(g_.size) + 2;
  const int slot = free_reports_.back();
  Status st = (*layer)->copyAsyncOn(report_words_ + static_cast<size_t>(slot) * words,
                                    streamOutcome(kind, round), words * 4, device_, stream_);
  Result<std::unique_ptr<dev::Event>> after =
      st.ok() ? (*layer)->recordOn(device_, stream_) : Result<std::unique_ptr<dev::Event>>(st);
  if (!after.ok()) {
    if (st.ok()) free_reports_.pop_back();  // (the copy is queued: its slot stays taken)
    MC_LOG(WARN, EP) << op << ": rank " << g_.rank << ": the dropped hook of round " << round
                     << ": " << after.status().toString();
    return;
  }
  free_reports_.pop_back();
  auto r = std::make_shared<StreamReport>();
  r->after = std::shared_ptr<dev::Event>(std::move(*after));
  r->slot = slot;
  r->op = op;
  r->round = round;
  reports_.push_back(std::move(r));
}

}  // namespace mooncake::ep
