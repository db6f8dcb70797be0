// mooncake._C's elastic-group functions (the raw layer under mooncake.pg's
// get_active_ranks, activate_ranks, ... in python/mooncake/_elastic.py; docs/elastic.md).
// Blocking calls release the GIL. Argument errors raise RuntimeError, as upstream's do.
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <stdexcept>
#include <tuple>

#include "torch_ext/csrc/process_group.h"

namespace py = pybind11;

namespace mooncake::torch_ext {

namespace {

pg::Communicator& elasticComm(ProcessGroupMooncake& g) {
  pg::Communicator& c = g.communicator();
  if (!c.elastic())
    throw std::runtime_error(
        "mooncake: this group is not elastic: create it with "
        "pg_options=mooncake.pg.MooncakeBackendOptions(...) to use the membership API");
  return c;
}

// std::invalid_argument (a rank outside the slots) as RuntimeError, like upstream.
template <class Fn>
auto asRuntime(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error(e.what());
  } catch (const std::logic_error& e) {
    throw std::runtime_error(e.what());
  }
}

using Proposal = std::tuple<int, uint64_t, std::vector<int>, std::string>;
Proposal toTuple(const pg::ProposalResult& r) {
  return {static_cast<int>(r.status), r.new_epoch, r.dropped_ranks, r.reject_reason};
}

MooncakeWork& mooncakeWork(const c10::intrusive_ptr<c10d::Work>& w) {
  auto* mw = dynamic_cast<MooncakeWork*>(w.get());
  if (mw == nullptr)
    throw std::runtime_error("mooncake: the work object does not come from a mooncake group");
  return *mw;
}

}  // namespace

void registerElasticApis(py::module_& m) {
  using G = ProcessGroupMooncake;
  m.def("_elastic", [](G& g) { return g.communicator().elastic(); });
#if MC_TORCH_HAS_BACKEND
  m.def("_link_wrapper",
        [](G& g, const c10::intrusive_ptr<c10d::ProcessGroup>& pg) { g.linkWrapper(pg); });
#endif
  m.def("_max_group_size", [](G& g) { return g.communicator().maxGroupSize(); });
  m.def("_active_ranks", [](G& g) { return (void)elasticComm(g), g.activeRanks(); });
  m.def("_current_epoch", [](G& g) { return elasticComm(g).epoch(); });
  m.def("_peer_state", [](G& g, const std::vector<int>& ranks) {
    std::vector<uint8_t> st = asRuntime([&] { return elasticComm(g).peerState(ranks); });
    return std::vector<bool>(st.begin(), st.end());
  });
  m.def("_num_synced_ranks", [](G& g) { return elasticComm(g).numSyncedRanks(); });
  m.def(
      "_activate_ranks",
      [](G& g, const std::vector<int>& ranks) {
        return asRuntime([&] { return toTuple(elasticComm(g).activateRanks(ranks)); });
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_deactivate_ranks",
      [](G& g, const std::vector<int>& ranks) {
        return asRuntime([&] { return toTuple(elasticComm(g).deactivateRanks(ranks)); });
      },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_join_group", [](G& g) { asRuntime([&] { elasticComm(g).joinGroup(); }); },
      py::call_guard<py::gil_scoped_release>());
  m.def(
      "_sync_after_failure",
      [](G& g) {
        pg::SyncResult r = asRuntime([&] { return elasticComm(g).syncAfterFailure(); });
        return std::make_tuple(static_cast<int>(r.status), r.reject_reason);
      },
      py::call_guard<py::gil_scoped_release>());
  m.def("_work_local_success", [](const c10::intrusive_ptr<c10d::Work>& w) {
    return mooncakeWork(w).localSuccess();
  });
  m.def("_work_failed_ranks_hint", [](const c10::intrusive_ptr<c10d::Work>& w) {
    std::vector<uint8_t> h = mooncakeWork(w).failedRanksHint();
    at::Tensor t = at::zeros({static_cast<int64_t>(h.size())}, at::kInt);
    for (size_t i = 0; i < h.size(); ++i) t.data_ptr<int32_t>()[i] = h[i];
    return t;
  });
  m.def("set_collective_timeout_us", [](int64_t us) {
    pg::setCollectiveTimeout(std::chrono::microseconds(us));
  });
  m.def("set_p2p_timeout_us",
        [](int64_t us) { pg::setP2pTimeout(std::chrono::microseconds(us)); });
  m.def("set_fault_reconciliation_window_us",
        [](int64_t us) { pg::setReconciliationWindow(std::chrono::microseconds(us)); });
}

}  // namespace mooncake::torch_ext
