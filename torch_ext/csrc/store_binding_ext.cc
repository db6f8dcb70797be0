// The rest of upstream's MooncakeDistributedStore API on mooncake._C.StoreClient: upserts,
// buffers handed out of the local buffer (get_buffer, batch_get_buffer, BufferPool leases),
// ranged reads, replica descriptors and clears, health, tensor views. Conversions only; the
// Python side (mooncake/store.py) adds upstream's names, defaults and return conventions.
#include <ATen/ATen.h>

#include <algorithm>
#include <string>

#include "engine/device/device.h"
#include "torch_ext/csrc/store_py.h"

namespace mooncake::torch_ext {
namespace {

using Nogil = py::call_guard<py::gil_scoped_release>;

// A slice of the client's local buffer holding an object's bytes (or handed out empty by
// lease()): upstream's BufferHandle, with the buffer protocol (1-D, itemsize 1, writable), so
// memoryview(), bytes() and torch.frombuffer() take it without a copy. The slice returns to the
// local buffer when the handle is dropped.
class BufferHandle {
 public:
  BufferHandle(store::LocalBuffer::Lease lease, uint64_t size)
      : lease_(std::move(lease)), size_(size) {}
  uint64_t ptr() const { return reinterpret_cast<uint64_t>(lease_.data()); }
  uint64_t size() const { return size_; }
  char* data() const { return lease_.data(); }

 private:
  store::LocalBuffer::Lease lease_;
  uint64_t size_;
};

py::object handleOrNone(std::optional<BufferHandle> h) {
  if (!h) return py::none();
  return py::cast(std::move(*h));
}

// Reads key into a fresh local-buffer slice. nullopt on a miss, on no local buffer, or when
// the object does not fit in what is free of it now.
std::optional<BufferHandle> readIntoLease(PyStore& s, const std::string& key) {
  store::LocalBuffer* lb = s.local();
  if (!s.c() || lb == nullptr) return std::nullopt;
  for (int attempt = 0; attempt < 2; ++attempt) {  // the object may be replaced in between
    auto size = s.c()->getSize(key);
    if (!size.ok() || *size == 0) return std::nullopt;
    auto lease = lb->acquire(*size);
    if (!lease) return std::nullopt;
    // A copy of the lease keeps the slice out of other hands while a read that timed out may
    // still land in it.
    auto got = s.c()->getInto(key, lease->data(), lease->size(),
                              std::make_shared<store::LocalBuffer::Lease>(*lease));
    if (got.ok()) return BufferHandle(std::move(*lease), *got);
    if (got.error() != ErrorCode::BUFFER_OVERFLOW) return std::nullopt;
  }
  return std::nullopt;
}

std::vector<std::pair<const void*, size_t>> partsOf(const std::vector<py::buffer>& bufs,
                                                    std::vector<py::buffer_info>* keep) {
  keep->resize(bufs.size());
  std::vector<std::pair<const void*, size_t>> out;
  for (size_t i = 0; i < bufs.size(); ++i) {
    auto v = viewOf(bufs[i], &(*keep)[i]);
    out.emplace_back(v.data(), v.size());
  }
  return out;
}

// Tensor objects (store_binding.cc's put_tensor): magic, dtype, ndim, shape, then the bytes.
std::string tensorHeader(const at::Tensor& t) {
  std::string h;
  auto add = [&](const void* p, size_t n) { h.append(static_cast<const char*>(p), n); };
  uint32_t magic = kTensorMagic, dtype = static_cast<uint32_t>(t.scalar_type()),
           ndim = static_cast<uint32_t>(t.dim());
  add(&magic, 4);
  add(&dtype, 4);
  add(&ndim, 4);
  for (int64_t d : t.sizes()) add(&d, 8);
  return h;
}

// A tensor over [p, p + n) (a serialized tensor object), without a copy; None when malformed.
// The object may be in GPU memory of the engine's device layer (a registered GPU buffer that
// get_into filled): the header is read with the layer's copies and the tensor views that
// memory (a CUDA tensor on the buffer's device; over the simulation a CPU tensor on its
// memory, which host code must not touch).
py::object tensorView(const char* p, uint64_t n) {
  if (n < 12) return py::none();
  char head[12 + 8 * 64];
  const bool gpu = engine::device::isDeviceMemory(p);
  const char* h = p;
  if (gpu) {
    const size_t hn = std::min<uint64_t>(n, sizeof head);
    if (!engine::device::copy(head, p, hn, engine::deadlineInMs(60000)).ok()) return py::none();
    h = head;
  }
  uint32_t magic, dtype, ndim;
  std::memcpy(&magic, h, 4);
  std::memcpy(&dtype, h + 4, 4);
  std::memcpy(&ndim, h + 8, 4);
  if (magic != kTensorMagic || ndim > 64 || n < 12 + 8ull * ndim ||
      dtype >= static_cast<uint32_t>(at::ScalarType::NumOptions))
    return py::none();
  std::vector<int64_t> shape(ndim);
  std::memcpy(shape.data(), h + 12, 8ull * ndim);
  auto opts = at::TensorOptions().dtype(static_cast<at::ScalarType>(dtype));
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) return py::none();
    numel *= d;
  }
  const uint64_t hdr = 12 + 8ull * ndim;
  if (n - hdr != static_cast<uint64_t>(numel) * at::elementSize(opts.dtype().toScalarType()))
    return py::none();
  if (gpu) {
    auto layer = engine::device::get();
    if (layer.ok() && std::string((*layer)->name()) == "cuda")
      opts = opts.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(
                                                   (*layer)->pointer(p).ordinal)));
  }
  return py::cast(at::from_blob(const_cast<char*>(p + hdr), shape, opts));
}

}  // namespace

void addStoreExtApis(py::module_& m, py::class_<PyStore>& cls) {
  py::class_<BufferHandle>(m, "BufferHandle", py::buffer_protocol(),
                           "Bytes of an object in the client's local buffer (get_buffer).")
      .def_buffer([](BufferHandle& h) {
        return py::buffer_info(h.data(), 1, py::format_descriptor<int8_t>::format(), 1,
                               {static_cast<py::ssize_t>(h.size())}, {1});
      })
      .def("ptr", &BufferHandle::ptr)
      .def("size", &BufferHandle::size)
      .def("__len__", &BufferHandle::size);

  cls.def_property_readonly("local_buffer_size",
                            guarded([](PyStore& s) -> uint64_t {
                              return s.local() != nullptr ? s.local()->capacity() : 0;
                            }))
      .def(
          "lease",
          guarded([](PyStore& s, uint64_t size) -> py::object {
            if (s.local() == nullptr) return py::none();
            auto l = s.local()->acquire(size);
            if (!l) return py::none();
            return py::cast(BufferHandle(std::move(*l), size));
          }),
          "A free slice of the local buffer (BufferPool), or None when it does not fit now.")
      .def("get_buffer",
           guarded([](PyStore& s, const std::string& key) {
             std::optional<BufferHandle> h;
             {
               py::gil_scoped_release nogil;
               h = readIntoLease(s, key);
             }
             return handleOrNone(std::move(h));
           }))
      .def("batch_get_buffer",
           guarded([](PyStore& s, const std::vector<std::string>& keys) {
             std::vector<std::optional<BufferHandle>> hs(keys.size());
             {
               py::gil_scoped_release nogil;
               store::LocalBuffer* lb = s.local();
               if (s.c() && lb != nullptr && !keys.empty()) {
                 std::vector<std::optional<store::LocalBuffer::Lease>> leases(keys.size());
                 std::vector<std::pair<void*, size_t>> bufs(keys.size(), {nullptr, 0});
                 for (size_t i = 0; i < keys.size(); ++i) {
                   auto size = s.c()->getSize(keys[i]);
                   if (!size.ok() || *size == 0) continue;
                   leases[i] = lb->acquire(*size);
                   if (leases[i]) bufs[i] = {leases[i]->data(), leases[i]->size()};
                 }
                 auto got = s.c()->batchGetInto(  // one engine batch; copies of the leases
                     keys, bufs, std::make_shared<decltype(leases)>(leases));  // (getInto)
                 for (size_t i = 0; i < keys.size(); ++i) {
                   if (leases[i] && got[i].ok())
                     hs[i] = BufferHandle(std::move(*leases[i]), *got[i]);
                   else if (leases[i] && got[i].error() == ErrorCode::BUFFER_OVERFLOW)
                     hs[i] = readIntoLease(s, keys[i]);  // replaced meanwhile: once more
                 }
               }
             }
             py::list out;
             for (auto& h : hs) out.append(handleOrNone(std::move(h)));
             return out;
           }))
      // ---- upserts ----
      .def("upsert_parts",
           guarded([](PyStore& s, const std::string& key, std::vector<py::buffer> parts,
              const ReplicateConfig& c) -> int64_t {
             if (!s.c()) return kNotSetUp;
             std::vector<py::buffer_info> keep;
             auto ps = partsOf(parts, &keep);
             py::gil_scoped_release nogil;
             return code(s.c()->upsertParts(key, ps, c));
           }))
      .def(
          "upsert_from",
          guarded([](PyStore& s, const std::string& key, uintptr_t ptr, size_t size,
             const ReplicateConfig& c) -> int64_t {
            if (!s.c()) return kNotSetUp;
            if (!s.c()->isRegistered(reinterpret_cast<void*>(ptr), size))
              return code(ErrorCode::INVALID_PARAMS);
            return code(s.c()->upsert(key, reinterpret_cast<void*>(ptr), size, c));
          }),
          Nogil())
      // ---- put sessions (StoreClient::putSession*) ----
      .def(
          "put_session_start",
          guarded([](PyStore& s, const std::vector<std::string>& keys, const std::vector<uint64_t>& sizes,
             const ReplicateConfig& c) -> std::vector<int64_t> {
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            auto r = s.c()->putSessionStart(keys, sizes, c);
            for (size_t i = 0; i < keys.size(); ++i) out[i] = code(r[i]);
            return out;
          }),
          "Per key: 0 (a session is open), or a negative code.", Nogil())
      .def(
          "put_session_ranges",
          guarded([](PyStore& s, const std::vector<std::string>& keys,
             const std::vector<std::vector<uintptr_t>>& srcs,
             const std::vector<std::vector<uint64_t>>& sizes,
             const std::vector<std::vector<uint64_t>>& dst_offsets) -> std::vector<int64_t> {
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            std::vector<std::vector<store::StoreClient::SourceRange>> ranges(keys.size());
            std::vector<bool> bad(keys.size(), false);
            for (size_t i = 0; i < keys.size(); ++i) {
              bad[i] = i >= srcs.size() || i >= sizes.size() || i >= dst_offsets.size() ||
                       srcs[i].size() != sizes[i].size() ||
                       srcs[i].size() != dst_offsets[i].size();
              if (bad[i]) continue;
              for (size_t j = 0; j < srcs[i].size(); ++j) {
                const void* p = reinterpret_cast<const void*>(srcs[i][j]);
                // An unregistered source is refused: INVALID_PARAMS for its key.
                ranges[i].push_back({s.c()->isRegistered(p, sizes[i][j]) ? p : nullptr,
                                     dst_offsets[i][j], sizes[i][j]});
              }
            }
            auto got = s.c()->putSessionRanges(keys, ranges);
            for (size_t i = 0; i < keys.size(); ++i)
              out[i] = bad[i] ? code(ErrorCode::INVALID_PARAMS) : valueOr(got[i]);
            return out;
          }),
          "Per key: bytes written, or a negative code (sources must be registered).", Nogil())
      .def(
          "put_session_end",
          guarded([](PyStore& s, const std::vector<std::string>& keys) -> std::vector<int64_t> {
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            auto r = s.c()->putSessionEnd(keys);
            for (size_t i = 0; i < keys.size(); ++i) out[i] = code(r[i]);
            return out;
          }),
          Nogil())
      .def(
          "put_session_revoke",
          guarded([](PyStore& s, const std::vector<std::string>& keys) -> std::vector<int64_t> {
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            for (size_t i = 0; i < keys.size(); ++i)
              out[i] = code(s.c()->putSessionRevoke(keys[i]));
            return out;
          }),
          Nogil())
      // ---- ranges and replicas ----
      .def(
          "get_ranges",
          guarded([](PyStore& s, const std::string& key, const std::vector<uintptr_t>& dsts,
             const std::vector<uint64_t>& src_offsets,
             const std::vector<uint64_t>& sizes) -> std::vector<int64_t> {
            std::vector<int64_t> out(dsts.size(), kNotSetUp);
            if (!s.c()) return out;
            std::vector<store::StoreClient::Range> rs;
            for (size_t i = 0; i < dsts.size(); ++i) {
              void* d = s.c()->isRegistered(reinterpret_cast<void*>(dsts[i]), sizes[i])
                            ? reinterpret_cast<void*>(dsts[i])
                            : nullptr;  // refused: INVALID_PARAMS for this range
              rs.push_back({src_offsets[i], sizes[i], d});
            }
            auto got = s.c()->getRanges(key, rs);
            for (size_t i = 0; i < got.size(); ++i) out[i] = valueOr(got[i]);
            return out;
          }),
          "Per range: bytes copied, or a negative code (dst must be registered).", Nogil())
      .def(
          "read_session_start",
          guarded([](PyStore& s, const std::vector<std::string>& keys) -> std::vector<int64_t> {
            std::vector<int64_t> out(keys.size(), kNotSetUp);
            if (!s.c()) return out;
            auto r = s.c()->readSessionStart(keys);
            for (size_t i = 0; i < keys.size(); ++i) out[i] = code(r[i]);
            return out;
          }),
          "Per key: 0 (its replica list is kept for batch_get_ranges), or a negative code.",
          Nogil())
      .def(
          "read_session_end",
          guarded([](PyStore& s, const std::vector<std::string>& keys) {
            if (s.c()) s.c()->readSessionEnd(keys);
          }),
          Nogil())
      .def(
          "batch_get_ranges",
          guarded([](PyStore& s, const std::vector<std::string>& keys,
             const std::vector<std::vector<uintptr_t>>& dsts,
             const std::vector<std::vector<uint64_t>>& src_offsets,
             const std::vector<std::vector<uint64_t>>& sizes)
              -> std::vector<std::vector<int64_t>> {
            // Lists of matching lengths per key (the caller checks): get_ranges' ranges per key.
            std::vector<std::vector<int64_t>> out(keys.size());
            if (dsts.size() != keys.size() || src_offsets.size() != keys.size() ||
                sizes.size() != keys.size()) {
              for (auto& o : out) o.assign(1, code(ErrorCode::INVALID_PARAMS));
              return out;
            }
            std::vector<std::vector<store::StoreClient::Range>> rs(keys.size());
            for (size_t i = 0; i < keys.size(); ++i) {
              const size_t m = std::min({dsts[i].size(), src_offsets[i].size(), sizes[i].size()});
              out[i].assign(m, kNotSetUp);
              for (size_t j = 0; j < m; ++j) {
                void* d = s.c() && s.c()->isRegistered(reinterpret_cast<void*>(dsts[i][j]),
                                                       sizes[i][j])
                              ? reinterpret_cast<void*>(dsts[i][j])
                              : nullptr;  // refused: INVALID_PARAMS for this range
                rs[i].push_back({src_offsets[i][j], sizes[i][j], d});
              }
            }
            if (!s.c()) return out;
            auto got = s.c()->batchGetRanges(keys, rs);
            for (size_t i = 0; i < keys.size(); ++i)
              for (size_t j = 0; j < got[i].size(); ++j) out[i][j] = valueOr(got[i][j]);
            return out;
          }),
          "Per key, per range: bytes copied, or a negative code. One replica-list call.",
          Nogil())
      .def(
          "replica_list",
          guarded([](PyStore& s, const std::string& key) -> py::object {
            if (!s.c()) return py::none();
            store::ErrorOr<store::proto::GetReplicaListResponse> r(ErrorCode::INTERNAL_ERROR);
            {
              py::gil_scoped_release nogil;
              r = s.c()->replicaList(key);
            }
            if (!r.ok()) return py::int_(code(r.error()));
            py::list reps;
            for (const auto& rep : r->replicas()) {
              py::list pieces;
              for (const auto& p : rep.pieces())
                pieces.append(py::make_tuple(p.length(), p.address(), py::str(p.client_id()),
                                             py::str(p.segment_name())));
              reps.append(pieces);
            }
            return py::make_tuple(r->size(), reps);
          }),
          "(size, [[(length, address, client, segment) per piece] per replica]) or a code.")
      .def(
          "batch_replica_clear",
          guarded([](PyStore& s, const std::vector<std::string>& keys,
             const std::string& segment_name) -> std::vector<std::string> {
            if (!s.c()) return {};
            auto r = s.c()->batchReplicaClear(keys, segment_name);
            return r.ok() ? *r : std::vector<std::string>{};
          }),
          Nogil())
      .def(
          "ping", guarded([](PyStore& s) -> int64_t { return s.c() ? code(s.c()->ping()) : kNotSetUp; }),
          Nogil());

  m.def("tensor_header", [](const at::Tensor& t) { return py::bytes(tensorHeader(t)); },
        "Header of a serialized tensor object for a contiguous tensor.");
  m.def(
      "_is_device_memory",
      [](uintptr_t ptr) { return engine::device::isDeviceMemory(reinterpret_cast<void*>(ptr)); },
      "Whether the address is GPU memory of the engine's device layer.");
  m.def(
      "tensor_view",
      [](uintptr_t ptr, uint64_t size) { return tensorView(reinterpret_cast<const char*>(ptr), size); },
      "A tensor over a serialized tensor object at [ptr, ptr + size) (no copy), or None.");
}

}  // namespace mooncake::torch_ext
