// Python API of the store: mooncake._C.StoreClient (wrapped by mooncake.store.
// MooncakeDistributedStore) and mooncake._C.ReplicateConfig. Conversions only: every call goes
// down to store::StoreClient, with the GIL released while it runs. Return conventions are
// Mooncake Store's: 0 or a byte count on success, a negative ErrorCode value on failure.
#include "torch_ext/csrc/engine_handle.h"
#include "torch_ext/csrc/store_py.h"

namespace py = pybind11;

namespace mooncake::torch_ext {

void registerStoreApis(py::module_& m) {
  py::class_<ReplicateConfig>(m, "ReplicateConfig", "Mooncake's replication settings of a put.")
      .def(py::init<>())
      .def_readwrite("replica_num", &ReplicateConfig::replica_num)
      .def_readwrite("with_soft_pin", &ReplicateConfig::with_soft_pin)
      .def_readwrite("with_hard_pin", &ReplicateConfig::with_hard_pin)
      .def_readwrite("preferred_segment", &ReplicateConfig::preferred_segment)
      .def_readwrite("preferred_segments", &ReplicateConfig::preferred_segments)
      .def_readwrite("soft_pin_ttl_ms", &ReplicateConfig::soft_pin_ttl_ms)
      .def_readwrite("keep_soft_pin", &ReplicateConfig::keep_soft_pin)
      .def("__repr__", [](const ReplicateConfig& c) {
        return "ReplicateConfig(replica_num=" + std::to_string(c.replica_num) +
               ", with_soft_pin=" + (c.with_soft_pin ? "True" : "False") +
               ", with_hard_pin=" + (c.with_hard_pin ? "True" : "False") + ", preferred_segment='" +
               c.preferred_segment + "')";
      });

  using Nogil = py::call_guard<py::gil_scoped_release>;
  py::class_<PyStore> cls(m, "StoreClient", "Native store client; use mooncake.store.");
  addStoreExtApis(m, cls);
  addStoreDummyApis(m, cls);
  cls.def(py::init<>())
      .def(
          "setup",
          guarded([](PyStore& s, const std::string& local_hostname, uint64_t global_segment_size,
             uint64_t local_buffer_size, const std::string& protocol,
             const std::string& master_server_addr, py::object engine) {
            std::shared_ptr<engine::TransferEngine> shared;
            if (!engine.is_none()) shared = engine.cast<EngineHandle>().engine;  // else TypeError
            py::gil_scoped_release nogil;
            return s.setup(local_hostname, global_segment_size, local_buffer_size, protocol,
                           master_server_addr, std::move(shared));
          }),
          py::arg("local_hostname"), py::arg("global_segment_size"),
          py::arg("local_buffer_size"), py::arg("protocol"), py::arg("master_server_addr"),
          py::arg("engine") = py::none())
      .def("setup_from_group",
           guarded([](PyStore& s, py::object group, uint64_t segment_size,
                      const std::string& master_address) {
             return s.setupFromGroup(std::move(group), segment_size, master_address);
           }))
      .def("close",
           [](PyStore& s) {
             py::gil_scoped_release nogil;
             s.close();
           })
      .def("get_hostname", guarded([](PyStore& s) { return s.hostname(); }))
      .def("last_error", guarded([](PyStore& s) {
             py::gil_scoped_release nogil;  // (a setup in another thread holds the lock)
             return s.lastError();
           }),
           "Why the last setup failed (\"\" when it did not).")
      .def("is_setup", guarded([](PyStore& s) { return s.c() != nullptr; }))
      .def(
          "put",
          guarded([](PyStore& s, const std::string& key, py::buffer value, py::object cfg) -> int64_t {
            if (!s.c()) return kNotSetUp;
            py::buffer_info keep;
            auto v = viewOf(value, &keep);
            ReplicateConfig c = cfgOf(cfg);
            py::gil_scoped_release nogil;
            return code(s.c()->put(key, v.data(), v.size(), c));
          }),
          py::arg("key"), py::arg("value"), py::arg("config") = py::none())
      .def("put_parts",
           guarded([](PyStore& s, const std::string& key, std::vector<py::buffer> parts,
              py::object cfg) -> int64_t {
             if (!s.c()) return kNotSetUp;
             std::vector<py::buffer_info> keep(parts.size());
             std::vector<std::pair<const void*, size_t>> ps;
             for (size_t i = 0; i < parts.size(); ++i) {
               auto v = viewOf(parts[i], &keep[i]);
               ps.emplace_back(v.data(), v.size());
             }
             ReplicateConfig c = cfgOf(cfg);
             py::gil_scoped_release nogil;
             return code(s.c()->putParts(key, ps, c));
           }))
      .def("put_batch",
           guarded([](PyStore& s, const std::vector<std::string>& keys, std::vector<py::buffer> values,
              py::object cfg) -> int64_t {
             if (!s.c()) return kNotSetUp;
             if (keys.size() != values.size()) return code(ErrorCode::INVALID_PARAMS);
             std::vector<py::buffer_info> keep(values.size());
             std::vector<std::pair<const void*, size_t>> vs;
             for (size_t i = 0; i < values.size(); ++i) {
               auto v = viewOf(values[i], &keep[i]);
               vs.emplace_back(v.data(), v.size());
             }
             ReplicateConfig c = cfgOf(cfg);
             py::gil_scoped_release nogil;
             // Upstream: 0 when every key is stored; an existing key counts as stored.
             for (ErrorCode ec : s.c()->batchPut(keys, vs, c))
               if (ec != ErrorCode::OK && ec != ErrorCode::OBJECT_ALREADY_EXISTS) return code(ec);
             return 0;
           }))
      .def("get",
           guarded([](PyStore& s, const std::string& key) -> py::bytes {
             if (!s.c()) return py::bytes("");
             store::ErrorOr<std::string> r(ErrorCode::INTERNAL_ERROR);
             {
               py::gil_scoped_release nogil;
               r = s.c()->get(key);
             }
             return r.ok() ? py::bytes(*r) : py::bytes("");
           }))
      .def("get_batch",
           guarded([](PyStore& s, const std::vector<std::string>& keys) -> py::list {
             py::list out;
             if (!s.c()) {
               for (size_t i = 0; i < keys.size(); ++i) out.append(py::bytes(""));
               return out;
             }
             std::vector<store::ErrorOr<std::string>> r;
             {
               py::gil_scoped_release nogil;
               r = s.c()->batchGet(keys);
             }
             for (auto& x : r) out.append(x.ok() ? py::bytes(*x) : py::bytes(""));
             return out;
           }))
      .def(
          "register_buffer",
          guarded([](PyStore& s, uintptr_t ptr, size_t size) -> int64_t {
            if (!s.c()) return kNotSetUp;
            return code(s.c()->registerBuffer(reinterpret_cast<void*>(ptr), size));
          }),
          Nogil())
      .def(
          "unregister_buffer",
          guarded([](PyStore& s, uintptr_t ptr) -> int64_t {
            if (!s.c()) return kNotSetUp;
            return code(s.c()->unregisterBuffer(reinterpret_cast<void*>(ptr)));
          }),
          Nogil())
      .def(
          "put_from",
          guarded([](PyStore& s, const std::string& key, uintptr_t ptr, size_t size,
             const ReplicateConfig& c) -> int64_t {
            if (!s.c()) return kNotSetUp;
            if (!s.c()->isRegistered(reinterpret_cast<void*>(ptr), size))
              return code(ErrorCode::INVALID_PARAMS);
            return code(s.c()->put(key, reinterpret_cast<void*>(ptr), size, c));
          }),
          Nogil())
      .def(
          "get_into",
          guarded([](PyStore& s, const std::string& key, uintptr_t ptr, size_t size) -> int64_t {
            if (!s.c()) return kNotSetUp;
            if (!s.c()->isRegistered(reinterpret_cast<void*>(ptr), size))
              return code(ErrorCode::INVALID_PARAMS);
            return valueOr(s.c()->getInto(key, reinterpret_cast<void*>(ptr), size));
          }),
          Nogil())
      .def(
          "batch_put_from",
          guarded([](PyStore& s, const std::vector<std::string>& keys, const std::vector<uintptr_t>& ptrs,
             const std::vector<size_t>& sizes, const ReplicateConfig& c) -> std::vector<int64_t> {
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            if (ptrs.size() != keys.size() || sizes.size() != keys.size()) {
              std::fill(out.begin(), out.end(), code(ErrorCode::INVALID_PARAMS));
              return out;
            }
            std::vector<std::pair<const void*, size_t>> vs;
            for (size_t i = 0; i < keys.size(); ++i) {
              bool reg = s.c()->isRegistered(reinterpret_cast<void*>(ptrs[i]), sizes[i]);
              // An unregistered buffer fails its own key only.
              vs.emplace_back(reg ? reinterpret_cast<void*>(ptrs[i]) : nullptr, sizes[i]);
            }
            auto r = s.c()->batchPut(keys, vs, c);
            for (size_t i = 0; i < keys.size(); ++i) out[i] = code(r[i]);
            return out;
          }),
          Nogil())
      .def(
          "batch_get_into",
          guarded([](PyStore& s, const std::vector<std::string>& keys, const std::vector<uintptr_t>& ptrs,
             const std::vector<size_t>& sizes) -> std::vector<int64_t> {
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            if (ptrs.size() != keys.size() || sizes.size() != keys.size()) {
              std::fill(out.begin(), out.end(), code(ErrorCode::INVALID_PARAMS));
              return out;
            }
            std::vector<std::pair<void*, size_t>> bufs;
            for (size_t i = 0; i < keys.size(); ++i) {
              bool reg = s.c()->isRegistered(reinterpret_cast<void*>(ptrs[i]), sizes[i]);
              bufs.emplace_back(reg ? reinterpret_cast<void*>(ptrs[i]) : nullptr, sizes[i]);
            }
            auto r = s.c()->batchGetInto(keys, bufs);
            for (size_t i = 0; i < keys.size(); ++i) out[i] = valueOr(r[i]);
            return out;
          }),
          Nogil())
      .def(
          "batch_put_from_multi_buffers",
          guarded([](PyStore& s, const std::vector<std::string>& keys,
             const std::vector<std::vector<uintptr_t>>& ptrs,
             const std::vector<std::vector<size_t>>& sizes,
             const ReplicateConfig& c) -> std::vector<int64_t> {
            // Each key's object is the concatenation of its buffers.
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            for (size_t i = 0; i < keys.size(); ++i) {
              if (i >= ptrs.size() || i >= sizes.size() || ptrs[i].size() != sizes[i].size()) {
                out[i] = code(ErrorCode::INVALID_PARAMS);
                continue;
              }
              std::vector<std::pair<const void*, size_t>> parts;
              bool reg = true;
              for (size_t j = 0; j < ptrs[i].size(); ++j) {
                reg = reg && s.c()->isRegistered(reinterpret_cast<void*>(ptrs[i][j]), sizes[i][j]);
                parts.emplace_back(reinterpret_cast<void*>(ptrs[i][j]), sizes[i][j]);
              }
              out[i] =
                  reg ? code(s.c()->putParts(keys[i], parts, c)) : code(ErrorCode::INVALID_PARAMS);
            }
            return out;
          }),
          Nogil())
      .def(
          "batch_get_into_multi_buffers",
          guarded([](PyStore& s, const std::vector<std::string>& keys,
             const std::vector<std::vector<uintptr_t>>& ptrs,
             const std::vector<std::vector<size_t>>& sizes) -> std::vector<int64_t> {
            // The object is scattered over the key's buffers in order; returns bytes read.
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            for (size_t i = 0; i < keys.size(); ++i) {
              if (i >= ptrs.size() || i >= sizes.size() || ptrs[i].size() != sizes[i].size()) {
                out[i] = code(ErrorCode::INVALID_PARAMS);
                continue;
              }
              if (ptrs[i].size() == 1) {
                out[i] = s.c()->isRegistered(reinterpret_cast<void*>(ptrs[i][0]), sizes[i][0])
                             ? valueOr(s.c()->getInto(keys[i], reinterpret_cast<void*>(ptrs[i][0]),
                                                      sizes[i][0]))
                             : code(ErrorCode::INVALID_PARAMS);
                continue;
              }
              size_t cap = 0;
              for (size_t n : sizes[i]) cap += n;
              auto r = s.c()->get(keys[i]);
              if (!r.ok()) {
                out[i] = code(r.error());
                continue;
              }
              if (r->size() > cap) {
                out[i] = code(ErrorCode::BUFFER_OVERFLOW);
                continue;
              }
              size_t off = 0;
              for (size_t j = 0; j < ptrs[i].size() && off < r->size(); ++j) {
                size_t n = std::min(sizes[i][j], r->size() - off);
                std::memcpy(reinterpret_cast<void*>(ptrs[i][j]), r->data() + off, n);
                off += n;
              }
              out[i] = static_cast<int64_t>(r->size());
            }
            return out;
          }),
          Nogil())
      .def(
          "is_exist",
          guarded([](PyStore& s, const std::string& key) -> int64_t {
            if (!s.c()) return kNotSetUp;
            auto r = s.c()->exists(key);
            return r.ok() ? (*r ? 1 : 0) : code(r.error());
          }),
          Nogil())
      .def(
          "batch_is_exist",
          guarded([](PyStore& s, const std::vector<std::string>& keys) {
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            auto r = s.c()->batchExists(keys);
            for (size_t i = 0; i < keys.size(); ++i)
              out[i] = r[i].ok() ? (*r[i] ? 1 : 0) : code(r[i].error());
            return out;
          }),
          Nogil())
      .def(
          "get_size",
          guarded([](PyStore& s, const std::string& key) -> int64_t {
            if (!s.c()) return kNotSetUp;
            return valueOr(s.c()->getSize(key));
          }),
          Nogil())
      .def(
          "remove",
          guarded([](PyStore& s, const std::string& key, bool force) -> int64_t {
            if (!s.c()) return kNotSetUp;
            return code(s.c()->remove(key, force));
          }),
          py::arg("key"), py::arg("force") = false, Nogil())
      .def(
          "remove_by_regex",
          guarded([](PyStore& s, const std::string& re, bool force) -> int64_t {
            if (!s.c()) return kNotSetUp;
            return valueOr(s.c()->removeByRegex(re, force));
          }),
          py::arg("regex"), py::arg("force") = false, Nogil())
      .def(
          "remove_all",
          guarded([](PyStore& s, bool force) -> int64_t {
            if (!s.c()) return kNotSetUp;
            return valueOr(s.c()->removeAll(force));
          }),
          py::arg("force") = false, Nogil())
      .def(
          "put_tensor",
          guarded([](PyStore& s, const std::string& key, const at::Tensor& t, py::object cfg) -> int64_t {
            if (!s.c()) return kNotSetUp;
            if (!t.device().is_cpu()) return code(ErrorCode::INVALID_PARAMS);
            at::Tensor ct = t.contiguous();
            std::string header;
            auto add = [&](const void* p, size_t n) {
              header.append(static_cast<const char*>(p), n);
            };
            uint32_t magic = kTensorMagic, dtype = static_cast<uint32_t>(ct.scalar_type()),
                     ndim = static_cast<uint32_t>(ct.dim());
            add(&magic, 4);
            add(&dtype, 4);
            add(&ndim, 4);
            for (int64_t d : ct.sizes()) add(&d, 8);
            ReplicateConfig c = cfgOf(cfg);
            size_t nbytes = static_cast<size_t>(ct.numel()) * ct.element_size();
            py::gil_scoped_release nogil;
            return code(
                s.c()->putParts(key, {{header.data(), header.size()}, {ct.data_ptr(), nbytes}}, c));
          }),
          py::arg("key"), py::arg("tensor"), py::arg("config") = py::none())
      .def("get_tensor", guarded([](PyStore& s, const std::string& key) -> py::object {
        if (!s.c()) return py::none();
        store::ErrorOr<std::string> r(ErrorCode::INTERNAL_ERROR);
        {
          py::gil_scoped_release nogil;
          r = s.c()->get(key);
        }
        if (!r.ok() || r->size() < 12) return py::none();
        const char* p = r->data();
        uint32_t magic, dtype, ndim;
        std::memcpy(&magic, p, 4);
        std::memcpy(&dtype, p + 4, 4);
        std::memcpy(&ndim, p + 8, 4);
        if (magic != kTensorMagic || ndim > 64 || r->size() < 12 + 8ull * ndim) return py::none();
        std::vector<int64_t> shape(ndim);
        std::memcpy(shape.data(), p + 12, 8ull * ndim);
        at::Tensor t =
            at::empty(shape, at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype)));
        size_t nbytes = static_cast<size_t>(t.numel()) * t.element_size();
        if (r->size() != 12 + 8ull * ndim + nbytes) return py::none();
        std::memcpy(t.data_ptr(), p + 12 + 8ull * ndim, nbytes);
        return py::cast(t);
      }));

  m.attr("STORE_MASTER_NAME") = py::str(store::kMasterName);
}

}  // namespace mooncake::torch_ext
