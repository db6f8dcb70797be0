#include "tests/engine/peer_fixture.h"
#include "tests/common/test_secret.h"
#include "tests/fakes/verbs/fake_verbs_control.h"

#include <dirent.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace mooncake::test {

HostBuffer::HostBuffer(size_t n) : size(n) {
  p = static_cast<uint8_t*>(std::aligned_alloc(64, (n + 63) / 64 * 64));
}

HostBuffer::~HostBuffer() { std::free(p); }

namespace {

// Entries of /dev/shm whose names start with `start`.
std::vector<std::string> shmFiles(const std::string& start) {
  std::vector<std::string> out;
  DIR* d = opendir("/dev/shm");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    if (std::string(e->d_name).rfind(start, 0) == 0) out.push_back(e->d_name);
  }
  closedir(d);
  return out;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

void PeerTestBase::SetUp() {
  // Shared-memory files of this test (its engines and its peers', which inherit the
  // environment) get a prefix of their own: TearDown checks that clean exits left none
  // behind and removes those of peers that were killed (they cannot clean up).
  shm_prefix_ = "mct" + std::to_string(getpid());
  setenv("MC_SHM_PREFIX", shm_prefix_.c_str(), 1);
  auto srv = engine::TcpRendezvousServer::start("127.0.0.1", 0, mooncake::test::jobSecret());
  ASSERT_TRUE(srv.ok()) << "rendezvous server: " << srv.status().toString();
  server_ = std::move(srv).value();
  ASSERT_NE(server_->port(), 0);
  auto cli = engine::TcpRendezvousClient::connect("127.0.0.1", server_->port(), mooncake::test::jobSecret(),
                                                  engine::deadlineInMs(5000));
  ASSERT_TRUE(cli.ok()) << "rendezvous client: " << cli.status().toString();
  rdv_ = std::move(cli).value();
}

void PeerTestBase::TearDown() {
  for (auto& p : peers_) {
    bool killed = std::find(killed_.begin(), killed_.end(), p.get()) != killed_.end();
    if (killed) continue;
    int rc = p->shutdown();
    EXPECT_EQ(rc, 0) << "peer '" << p->config().name << "' (pid " << p->pid()
                     << ") did not exit cleanly: " << (rc > 128 ? "signal " : "code ")
                     << (rc > 128 ? rc - 128 : rc);
  }
  for (auto& p : peers_) {
    bool killed = std::find(killed_.begin(), killed_.end(), p.get()) != killed_.end();
    std::string pid = std::to_string(p->pid());
    auto left = shmFiles(shm_prefix_ + "-" + pid + "-");
    auto inbox = shmFiles(shm_prefix_ + "-inbox-" + pid + "-");
    left.insert(left.end(), inbox.begin(), inbox.end());
    if (!killed) {
      EXPECT_TRUE(left.empty()) << "peer '" << p->config().name << "' exited cleanly but left "
                                << "shared-memory files behind: " << join(left);
    }
  }
  peers_.clear();  // kills and reaps whatever is left
  rdv_.reset();
  server_.reset();
  const std::string me = std::to_string(getpid());
  auto mine = shmFiles(shm_prefix_ + "-" + me + "-");
  auto my_inbox = shmFiles(shm_prefix_ + "-inbox-" + me + "-");
  mine.insert(mine.end(), my_inbox.begin(), my_inbox.end());
  EXPECT_TRUE(mine.empty()) << "this process's destroyed engines left shared-memory files: "
                            << join(mine);
  for (const auto& f : shmFiles(shm_prefix_)) shm_unlink(("/" + f).c_str());
  unsetenv("MC_SHM_PREFIX");
  if (!fv_config_.empty()) {
    fakeverbs::removeFabricFiles(fv_fabric_);
    std::remove(fv_config_.c_str());
    unsetenv("MC_FAKE_VERBS_CONFIG");
    unsetenv("MC_FAKE_VERBS_FABRIC");
  }
}

uint16_t PeerTestBase::rdvPort() const { return server_->port(); }

namespace {
bool g_fv_config_written = false;  // some test of this process wrote an emulator config
}  // namespace

bool PeerTestBase::setFakeNicsInfiniBand() {
  if (g_fv_config_written) return false;
  fv_ib_ = true;
  return true;
}

// rdma runs over the verbs emulator: a config with two RoCE NICs that every process of the
// test sees, on a fabric of this test's own (its shared-memory files are removed in TearDown).
// The environment is set before the first engine or peer, so peers inherit it.
void PeerTestBase::prepareTransport(const std::string& transport) {
  if (transport != "rdma" || !fv_config_.empty()) return;
  fv_fabric_ = "mct" + std::to_string(getpid());
  fv_config_ = "/tmp/mcfv-" + fv_fabric_ + ".conf";
  fakeverbs::removeFabricFiles(fv_fabric_);  // an earlier process with this pid that did not tear down
  FILE* f = std::fopen(fv_config_.c_str(), "w");
  ASSERT_NE(f, nullptr) << fv_config_;
  // PCI addresses: the NICs of tests/data/topology/2socket.xml (mlx5_0 on NUMA node 0,
  // mlx5_1 on node 1), for tests that load that topology (rdma_test.cc).
  const char* link0 = fv_ib_ ? "link=ib lid=11" : "link=ethernet ip=10.9.0.1";
  const char* link1 = fv_ib_ ? "link=ib lid=12" : "link=ethernet ip=10.9.0.2";
  std::fprintf(f,
               "# written by the engine's peer tests (PeerTestBase)\n"
               "device mlx5_0 pci=0000:13:00.0 %s mtu=4096%s\n"
               "device mlx5_1 pci=0000:53:00.0 %s mtu=4096%s\n",
               link0, fv_device_extra_.c_str(), link1, fv_device_extra_.c_str());
  std::fclose(f);
  setenv("MC_FAKE_VERBS_CONFIG", fv_config_.c_str(), 1);
  setenv("MC_FAKE_VERBS_FABRIC", fv_fabric_.c_str(), 1);
  g_fv_config_written = true;
}

std::unique_ptr<TransferEngine> PeerTestBase::makeEngine(const std::string& transport,
                                                         const std::string& name,
                                                         const std::string& secret) {
  prepareTransport(transport);
  engine::EngineOptions opt;
  opt.name = name;
  opt.transport = transport;
  opt.secret = secret;
  auto e = TransferEngine::create(opt);
  EXPECT_TRUE(e.ok()) << "TransferEngine::create(" << name << ", " << transport
                      << "): " << e.status().toString();
  if (!e.ok()) return nullptr;
  std::unique_ptr<TransferEngine> eng = std::move(e).value();
  Status st = eng->publish(*rdv_);
  EXPECT_TRUE(st.ok()) << "publish: " << st.toString();
  return eng;
}

PeerProcess* PeerTestBase::spawnPeer(const PeerConfig& cfg) {
  prepareTransport(cfg.transport);
  std::string err;
  auto p = PeerProcess::spawn(cfg, server_->port(), &err);
  EXPECT_TRUE(p != nullptr) << err;
  if (!p) return nullptr;
  peers_.push_back(std::move(p));
  return peers_.back().get();
}

PeerId PeerTestBase::openPeer(TransferEngine& eng, const std::string& name) {
  auto t0 = SteadyClock::now();
  auto r = eng.openPeer(*rdv_, name, engine::deadlineInMs(10000));
  EXPECT_TRUE(r.ok()) << "openPeer(" << name << ") after " << msSince(t0)
                      << " ms: " << r.status().toString();
  return r.ok() ? r.value() : engine::kInvalidPeer;
}

Status PeerTestBase::transfer(TransferEngine& eng, OpCode op, void* local, uint64_t len,
                              PeerId peer, uint64_t remote, int timeout_ms) {
  TransferRequest req{op, local, len, peer, remote};
  return eng.transfer({req}, engine::deadlineInMs(timeout_ms));
}

}  // namespace mooncake::test
