// Upstream's standalone pairing (SGLang's standalone_storage mode): `mooncake_client` lends the
// memory, and the serving process calls setup_dummy(mem_pool_size, local_buffer_size,
// "host:port") with the address of that client's --port.
//
// Here the pairing is a lookup, not a proxy: mooncake_client serves on --port a key/value
// service (the engine's TcpRendezvousServer: the job secret first, bounded frames, handshake
// deadline) that says which master it lends to, with which protocol and NICs, and its segment
// name. setup_dummy reads that and joins the same store as a client that lends nothing, so its
// puts and gets move bytes between its own registered memory and the pool one-sidedly, with no
// hop through the mooncake_client process (docs/compat.md says how this differs from upstream).
#include <map>

#include "torch_ext/csrc/store_py.h"

namespace mooncake::torch_ext {

namespace {

constexpr const char* kPrefix = "mooncake_client/";
constexpr const char* kApi = "1";
// What a dummy needs; "api" names this layout so a mismatch is an error, not a guess.
const char* const kKeys[] = {"api", "master_server_addr", "protocol", "rdma_devices", "segment"};

// "host:port" or "[v6]:port" -> host (brackets removed) and port; false when malformed.
bool splitHostPort(const std::string& addr, std::string* host, int* port) {
  auto colon = addr.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == addr.size()) return false;
  const std::string digits = addr.substr(colon + 1);
  if (digits.find_first_not_of("0123456789") != std::string::npos || digits.size() > 5)
    return false;
  std::string h = addr.substr(0, colon);
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') {
    h = h.substr(1, h.size() - 2);
  } else if (h.find_first_of(":[]") != std::string::npos) {
    return false;  // a bare IPv6 address: ambiguous without brackets
  }
  *host = h;
  *port = std::stoi(digits);
  return *port > 0 && *port <= 65535;
}

// Reads what the mooncake_client at host:port serves into *info, all by `deadline`: 0, or a
// negative code and *why. The job secret must be there already (no wait for the file, unlike a
// client racing the master that creates it: the mooncake_client is up and used it).
int64_t lookup(const std::string& address, const std::string& host, uint16_t port,
               engine::Deadline deadline, std::map<std::string, std::string>* info,
               std::string* why) {
  auto secret = engine::resolveSecret("", engine::SecretFile::kDefault);
  if (!secret.ok()) {
    *why = "job secret: " + secret.status().toString();
    return code(ErrorCode::INVALID_PARAMS);
  }
  auto cli = engine::TcpRendezvousClient::connect(host, port, *secret, deadline);
  if (!cli.ok()) {
    *why = "the mooncake_client at " + address + ": " + cli.status().toString();
    return code(cli.status().code() == Code::kPermissionDenied ? ErrorCode::INVALID_PARAMS
                                                               : ErrorCode::RPC_FAIL);
  }
  for (const char* k : kKeys) {
    auto v = (*cli)->get(kPrefix + std::string(k), deadline);
    if (!v.ok()) {
      *why = address + " does not serve dummy clients (no '" + k +
             "'; is it a mooncake_client's --port?): " + v.status().toString();
      return code(ErrorCode::RPC_FAIL);
    }
    (*info)[k] = *v;
    if (std::string(k) == "api" && *v != kApi) {
      *why = "the mooncake_client at " + address + " speaks pairing version '" + *v +
             "', this library " + kApi;
      return code(ErrorCode::INVALID_PARAMS);
    }
  }
  return 0;
}

}  // namespace

void addStoreDummyApis(py::module_& m, py::class_<PyStore>& cls) {
  cls.def(
      "serve_dummies",
      guarded([](PyStore& s, const std::string& host, int port,
         std::map<std::string, std::string> info) -> int {
        if (!s.c()) throw std::runtime_error("serve_dummies: this client is not set up");
        if (s.servesDummies()) throw std::runtime_error("serve_dummies: already serving");
        if (port < 0 || port > 65535)
          throw std::invalid_argument("serve_dummies: port " + std::to_string(port) +
                                      " is not 0-65535");
        info["api"] = kApi;
        info["segment"] = s.hostname();
        for (const char* k : kKeys)
          if (!info.count(k)) throw std::invalid_argument(std::string("serve_dummies: no ") + k);
        py::gil_scoped_release nogil;
        auto secret = PyStore::clientSecret();
        if (!secret.ok()) throw std::runtime_error("job secret: " + secret.status().toString());
        auto srv = engine::TcpRendezvousServer::start(host, static_cast<uint16_t>(port), *secret);
        if (!srv.ok())
          throw std::runtime_error("cannot serve dummy clients on " + host + ":" +
                                   std::to_string(port) + ": " + srv.status().toString());
        uint16_t bound = (*srv)->port();
        // The server has no local setter: the values go in through a client of it, like any.
        auto cli = engine::TcpRendezvousClient::connect(host, bound, *secret,
                                                        engine::deadlineInMs(5000));
        if (!cli.ok()) throw std::runtime_error("own dummy service: " + cli.status().toString());
        for (const auto& [k, v] : info) {
          auto st = (*cli)->set(kPrefix + k, v);
          if (!st.ok()) throw std::runtime_error("own dummy service: " + st.toString());
        }
        s.keepDummyService(std::move(srv).value());
        return bound;
      }),
      py::arg("host"), py::arg("port"), py::arg("info"),
      "mooncake_client: serve, on host:port (0: any free port), what setup_dummy needs to join "
      "this client's store (its master, protocol, NICs and segment) to clients that present the "
      "job secret. Returns the port. Stopped by close().");

  m.def(
      "real_client_info",
      [](const std::string& server_address, int timeout_ms) -> py::tuple {
        std::string host;
        int port = 0;
        std::map<std::string, std::string> info;
        std::string why;
        int64_t rc = 0;
        if (!splitHostPort(server_address, &host, &port)) {
          rc = code(ErrorCode::INVALID_PARAMS);
          why = "server_address '" + server_address + "' is not host:port";
        } else {
          py::gil_scoped_release nogil;
          rc = lookup(server_address, host, static_cast<uint16_t>(port),
                      engine::deadlineInMs(std::max(timeout_ms, 1)), &info, &why);
        }
        if (rc != 0) info.clear();
        return py::make_tuple(rc, info, why);
      },
      py::arg("server_address"), py::arg("timeout_ms"),
      "setup_dummy's lookup: (0, info, \"\") with what the mooncake_client at server_address "
      "serves, or (negative code, {}, why); every step within timeout_ms.");
}

}  // namespace mooncake::torch_ext
