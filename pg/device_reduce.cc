#include "pg/device_reduce.h"

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "engine/device/device.h"
#include "engine/log.h"
#include "pg/communicator.h"
#include "pg/device_reduce_body.h"
#include "pg/reduce.h"

#if MC_PG_HAVE_REDUCE_IMAGE
// The fatbin of pg/device_reduce.cu (pg/device_reduce_image.c).
extern "C" const unsigned char mc_pg_reduce_fatbin[];
extern "C" const size_t mc_pg_reduce_fatbin_len;
#endif

namespace mooncake::pg {

namespace {

namespace dr = devred;
std::atomic<uint64_t> g_launches{0};
static_assert(static_cast<int>(DataType::kFloat32) == dr::kF32 &&
                  static_cast<int>(DataType::kBFloat16) == dr::kBF16 &&
                  static_cast<int>(DataType::kUInt8) == dr::kU8 &&
                  static_cast<int>(DataType::kBool) == dr::kBool &&
                  static_cast<int>(DataType::kComplex128) == dr::kC128,
              "pg/device_reduce_body.h's dtype numbers follow pg::DataType");
static_assert(static_cast<int>(ReduceOp::kAvg) == dr::kAvg &&
                  static_cast<int>(ReduceOp::kMax) == dr::kMax &&
                  static_cast<int>(ReduceOp::kBxor) == dr::kBxor,
              "pg/device_reduce_body.h's op numbers follow pg::ReduceOp");

struct HostLoop {
  const dr::Params* p;
  template <class F>
  void operator()(uint64_t count, F f) const {
    for (uint64_t k = 0; k < count; ++k) f(*p, k);
  }
};

bool fill(dr::Params* p, void* dst, void* dst2, const void* const* srcs, int n, size_t count,
          DataType t, ReduceOp op) {
  if (n < 1 || n > dr::kMaxSources || !reduceSupported(t, op)) return false;
  *p = dr::Params{};
  p->dst = reinterpret_cast<uint64_t>(dst);
  p->dst2 = reinterpret_cast<uint64_t>(dst2);
  p->count = count;
  p->n = static_cast<uint32_t>(n);
  p->dtype = static_cast<uint8_t>(t);
  p->op = static_cast<uint8_t>(op);
  for (int j = 0; j < n; ++j) p->src[j] = reinterpret_cast<uint64_t>(srcs[j]);
  return true;
}

// The simulation's form: every address through the layer's host view.
Status simKernel(const void* params, const engine::device::HostView& view) {
  dr::Params p = *static_cast<const dr::Params*>(params);
  const size_t bytes = p.count * dtypeSize(static_cast<DataType>(p.dtype));
  auto map = [&](uint64_t& a) -> Status {
    if (a == 0) return Status::OK();
    MC_ASSIGN_OR_RETURN(void* h, view.at(reinterpret_cast<const void*>(a), bytes));
    a = reinterpret_cast<uint64_t>(h);
    return Status::OK();
  };
  MC_RETURN_IF_ERROR(map(p.dst));
  MC_RETURN_IF_ERROR(map(p.dst2));
  for (uint32_t j = 0; j < p.n; ++j) MC_RETURN_IF_ERROR(map(p.src[j]));
  // The CPU's vectorised kernels (pg/reduce.h), equal bit for bit to the element form above
  // (tests/pg/device_reduce_test.cc), which runs one element per step: the simulation stands
  // for a device, and a scalar loop would make it many times slower than the host path it is
  // compared with (docs/gpu.md).
  const void* srcs[dr::kMaxSources];
  for (uint32_t j = 0; j < p.n; ++j) srcs[j] = reinterpret_cast<const void*>(p.src[j]);
  void* dst = reinterpret_cast<void*>(p.dst);
  void* dst2 = reinterpret_cast<void*>(p.dst2);
  try {
    reduceInto(dst != nullptr ? dst : dst2, dst != nullptr ? dst2 : nullptr, srcs,
               static_cast<int>(p.n), p.count, static_cast<DataType>(p.dtype),
               static_cast<ReduceOp>(p.op));
  } catch (const std::exception& e) {
    return MC_STATUS(kInvalidArgument, "mc_pg_reduce: " << e.what());
  }
  return Status::OK();
}

engine::device::Kernel kernel() {
  engine::device::Kernel k;
#if MC_PG_HAVE_REDUCE_IMAGE
  // An 8-byte aligned copy (the driver reads the fatbin's header in place).
  static const std::vector<uint64_t>* image = [] {
    auto* v = new std::vector<uint64_t>((mc_pg_reduce_fatbin_len + 7) / 8);
    std::memcpy(v->data(), mc_pg_reduce_fatbin, mc_pg_reduce_fatbin_len);
    return v;
  }();
  k.image = image->data();
#endif
  k.name = "mc_pg_reduce";
  k.host = &simKernel;
  return k;
}

}  // namespace

bool deviceReduceHasImage() {
#if MC_PG_HAVE_REDUCE_IMAGE
  return true;
#else
  return false;
#endif
}

bool deviceReduceOnHost(void* dst, void* dst2, const void* const* srcs, int n, size_t count,
                        DataType t, ReduceOp op) {
  dr::Params p;
  if (!fill(&p, dst, dst2, srcs, n, count, t, op)) return false;
  return count == 0 || dr::dispatch(p, HostLoop{&p});
}

bool deviceReduceAsync(void* dst, void* dst2, const void* const* srcs, int n, size_t count,
                       DataType t, ReduceOp op, int ordinal, const char* op_name,
                       const void* stream) {
  dr::Params p;
  if (!fill(&p, dst, dst2, srcs, n, count, t, op)) return false;
  auto layer = engine::device::get();
  if (!layer.ok()) return false;
  const bool sim = std::string((*layer)->name()) == "sim";
  if (!sim && !deviceReduceHasImage()) return false;
  if (count == 0) return true;
  // Elements per thread grow past 1 only for very large calls (grid capped).
  constexpr unsigned kBlock = 256;
  const uint64_t blocks = (count + kBlock - 1) / kBlock;
  const unsigned grid = static_cast<unsigned>(blocks < 4096 ? blocks : 4096);
  static std::atomic<bool> unloadable{false};  // this GPU cannot run the built image
  if (unloadable.load(std::memory_order_relaxed)) return false;
  Status st = (*layer)->launchOn(kernel(), grid, kBlock, &p, sizeof p, ordinal, stream);
  if (st.code() == Code::kNotSupported) {
    // No image for this GPU's architecture (MC_CUDA_ARCHS): reduce on the CPU from now on.
    if (!unloadable.exchange(true)) {
      MC_LOG(WARN, PG) << "the GPU reduction kernel cannot run here (" << st.toString()
                       << "): GPU reductions run on the CPU";
    }
    return false;
  }
  if (!st.ok())
    throw CommError(std::string("mooncake pg: ") + op_name + ": the GPU reduction (" +
                        dtypeName(t) + ", " + reduceOpName(op) + ", " + std::to_string(count) +
                        " elements) failed to launch: " + st.toString(),
                    -1, op_name);
  g_launches.fetch_add(1, std::memory_order_relaxed);
  return true;
}

Status prepareDeviceReduce(int ordinal) {
  auto layer = engine::device::get();
  if (!layer.ok()) return layer.status();
  Status st = (*layer)->load(kernel(), ordinal);
  return st.code() == Code::kNotSupported ? Status::OK() : st;
}

uint64_t deviceReduceLaunches() { return g_launches.load(std::memory_order_relaxed); }

}  // namespace mooncake::pg
