// allGatherV (allGather is the equal-size case) and gather. Shm: every rank copies its
// block (a half at a time) into its own half, flag, the receivers copy straight out of the
// owners' halves. Messages: every rank sends its block to every receiver.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "pg/comm_impl.h"
#include "pg/copy.h"

namespace mooncake::pg::algo {

namespace {

// root < 0: everyone receives (allgather); else only root does (gather).
void run(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
         const std::vector<size_t>& bytes, int root) {
  const int n = c.size, me = c.rank;
  const bool receive = root < 0 || root == me;
  std::vector<size_t> displ(n + 1, 0);
  for (int r = 0; r < n; ++r) displ[r + 1] = displ[r] + bytes[r];
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  const bool so = displ[n] >= c.params.stream_out_bytes;
  if (receive && bytes[me] > 0 && dst + displ[me] != src) {
    char* mine = dst + displ[me];
    // Disjoint and large: streaming stores (no read-for-ownership of the output's lines).
    if (so && (mine + bytes[me] <= src || src + bytes[me] <= mine))
      copyToShared(mine, src, bytes[me]);
    else
      std::memmove(mine, src, bytes[me]);
  }
  if (n == 1 || displ[n] == 0) return;

  if (!c.shm) {
    for (int k = 1; k < n; ++k) {
      int j = (me + k) % n;
      if (root < 0 || j == root) c.net->sendPieces(op, j, src, bytes[me]);
    }
    if (receive)
      for (int k = 1; k < n; ++k) {
        int j = (me + n - k) % n;
        c.net->recvPieces(op, j, dst + displ[j], bytes[j]);
      }
    return;
  }
  ShmGroup& g = *c.shm;
  const size_t chunk = g.halfBytes();
  const size_t most = *std::max_element(bytes.begin(), bytes.end());
  for (size_t off = 0; off < most; off += chunk) {
    auto lenOf = [&](int r) { return bytes[r] > off ? std::min(chunk, bytes[r] - off) : 0; };
    uint64_t s = g.beginStep(op, lenOf(me) > 0);
    if (lenOf(me) > 0) copyToShared(g.half(me, s), src + off, lenOf(me));
    g.post(ShmGroup::kReady, s);
    if (receive) {
      for (int k = 1; k < n; ++k) {
        int j = (me + k) % n;  // start at different peers: spreads the reads
        size_t len = lenOf(j);
        if (len == 0) continue;
        g.wait(op, j, ShmGroup::kReady, s);
        copyOut(dst + displ[j] + off, g.half(j, s), len, so);
      }
    }
    g.endStep(s);
  }
  if (so) streamFence();
}

}  // namespace

void allGatherV(Communicator::Impl& c, const OpCtx& op, const void* in, void* out,
                const std::vector<size_t>& bytes) {
  run(c, op, in, out, bytes, -1);
}

void gather(Communicator::Impl& c, const OpCtx& op, const void* in, void* out, size_t bytes,
            int root) {
  run(c, op, in, out, std::vector<size_t>(c.size, bytes), root);
}

}  // namespace mooncake::pg::algo
