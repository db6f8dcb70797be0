// Communicator: a process group over one TransferEngine. Ranks exchange segments through a
// Rendezvous, register their comm buffers once, and run collectives and point-to-point ops
// on host memory. No torch here; torch_ext adapts c10d onto this.
//
// Contract (as c10d): collectives are called in the same order on every rank of the group.
// The blocking op methods are called by ONE thread at a time per communicator (the group's
// worker, see enqueue()); send/recv may be called from any thread concurrently with them.
// Every op is bounded by options.timeout; a dead peer makes the op throw CommError naming
// the rank and the op within ~2 s (engine peerStatus + control link).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "pg/types.h"

namespace mooncake::pg {

struct CommOptions {
  int rank = 0;
  int size = 1;
  // Rendezvous keys of this group are prefixed with it; distinct per group in a job.
  std::string group_name = "default";
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Bytes of the registered comm buffer per rank (0: MC_PG_BUFFER_BYTES).
  size_t buffer_bytes = 0;
};

class CommError : public std::runtime_error {
 public:
  CommError(const std::string& what, int peer_rank, std::string op)
      : std::runtime_error(what), peer_rank_(peer_rank), op_(std::move(op)) {}
  int peerRank() const { return peer_rank_; }  // -1 when no single peer is to blame
  const std::string& op() const { return op_; }

 private:
  int peer_rank_;
  std::string op_;
};

// Async completion of one enqueued op (the c10d Work's core).
class Work {
 public:
  // Waits until done or the timeout; rethrows the op's exception. Returns false on timeout.
  bool wait(std::chrono::milliseconds timeout);
  bool isCompleted() const;
  bool isSuccess() const;
  std::exception_ptr exception() const;
  // Called (once, on the worker thread) when the op finished.
  void onComplete(std::function<void()> cb);

  struct State;
  explicit Work(std::shared_ptr<State> s) : s_(std::move(s)) {}

 private:
  std::shared_ptr<State> s_;
};

class Communicator {
 public:
  // Collective over the group. The engine may be shared by several communicators (sub-
  // groups reuse their parent's engine and registered memory).
  static std::unique_ptr<Communicator> create(std::shared_ptr<engine::TransferEngine> engine,
                                              std::shared_ptr<engine::Rendezvous> rdv,
                                              const CommOptions& options);
  ~Communicator();

  int rank() const;
  int size() const;
  const CommOptions& options() const;
  engine::TransferEngine& engine();

  // Runs fn on the group's worker thread, in enqueue order; the Work carries its result.
  // A thrown exception lands in the Work.
  std::shared_ptr<Work> enqueue(std::string op_name, std::function<void()> fn);

  // ---- collectives on contiguous host memory; in == out allowed where it makes sense ----
  void allReduce(const void* in, void* out, size_t count, DataType t, ReduceOp op);
  void reduce(const void* in, void* out, size_t count, DataType t, ReduceOp op, int root);
  void broadcast(void* buf, size_t bytes, int root);
  // out holds size() blocks of `bytes`, rank order.
  void allGather(const void* in, void* out, size_t bytes);
  // Rank r contributes bytes[r] (may differ per rank); out is their concatenation.
  void allGatherV(const void* in, void* out, const std::vector<size_t>& bytes);
  void gather(const void* in, void* out, size_t bytes, int root);  // out used on root only
  void scatter(const void* in, void* out, size_t bytes, int root);  // in used on root only
  // in holds size() blocks of `count` elements; out gets the reduced block of this rank.
  void reduceScatter(const void* in, void* out, size_t count, DataType t, ReduceOp op);
  // Rank r sends send_bytes[j] from in + send_offsets[j] to rank j, which receives it at
  // out + recv_offsets[r]; recv_bytes[r] must equal what r sends (checked, CommError).
  void allToAllV(const void* in, const std::vector<size_t>& send_bytes,
                 const std::vector<size_t>& send_offsets, void* out,
                 const std::vector<size_t>& recv_bytes,
                 const std::vector<size_t>& recv_offsets);
  void barrier();

  // ---- point to point (any thread) ----
  // Completes when the data left this process (buffered at the receiver if needed).
  void send(const void* buf, size_t bytes, int dst, uint64_t tag);
  // src = -1: any source. Returns the source rank. Throws CommError on size mismatch.
  int recv(void* buf, size_t bytes, int src, uint64_t tag);

  // ---- what services built on the group (ep, store) reuse ----
  // The engine peer of a rank (this rank's own engine for rank()).
  engine::PeerId peerOf(int rank) const;
  std::shared_ptr<engine::Rendezvous> rendezvous() const;

  // How collectives travel: "shm" (every rank maps every other's buffer), "net" (engine
  // messages), or "hierarchical: H hosts, L ranks on this one" (a group spanning hosts:
  // allreduce goes through shared memory within each host and messages between hosts).
  const std::string& path() const;

  // ---- health ----
  // OK, or a CommError-worthy message naming the first dead rank.
  std::vector<int> deadRanks() const;

  class Impl;

 private:
  explicit Communicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace mooncake::pg
