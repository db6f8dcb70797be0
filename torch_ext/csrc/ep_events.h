// The event and hook objects of mooncake._C.EpBuffer's calls (torch_ext/csrc/ep_binding.cc,
// their only user): an async_finish call's event (a host task's, or a stream-ordered call's
// device event) and a return_recv_hook call's hook.
#pragma once

#include <pybind11/pybind11.h>

#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "engine/device/device.h"
#include "ep/buffer.h"
#include "torch_ext/csrc/gpu_tensors.h"

namespace mooncake::torch_ext::ep_py {

namespace py = pybind11;

// The caller's current stream of a GPU buffer's device: torch's (CUDA), or the simulation's
// copy stream, where the tests' copies of the outputs run.
inline const void* callerStream(bool cuda, int device, const char* op) {
  if (!cuda) return engine::device::kCopyStream;
  auto s = currentStream(c10::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)));
  if (!s)
    throw std::runtime_error(std::string(op) +
                             ": the current CUDA stream is unknown (torch's libc10_cuda is not "
                             "loaded); set MC_EP_STREAM_CALLS=0");
  return *s;
}

// A GPU buffer's call that waits on the host (normal mode, the layout, the waited low-latency
// path) cannot be captured into a CUDA graph: ValueError while the caller's stream captures.
// Asked before the call reserves a round: every rank refuses alike, and no give-up is queued
// into the capture (where every replay would give a round up).
inline void refuseCapture(int device, bool cuda, const char* op) {
  if (device < 0) return;
  auto layer = engine::device::get();
  if (!layer.ok()) return;
  const void* s = nullptr;
  try {
    s = callerStream(cuda, device, op);
  } catch (const std::exception&) {
    return;  // (no current stream known: no capture either)
  }
  if ((*layer)->capturing(device, s))
    throw std::invalid_argument(std::string(op) +
                                ": cannot run inside a CUDA-graph capture: it waits on the host "
                                "(only the stream-ordered low-latency dispatch and combine are "
                                "captured)");
}

class PyEvent {
 public:
  explicit PyEvent(std::shared_ptr<ep::EpEvent> e) : e_(std::move(e)) {}
  // A stream-ordered call's (async_finish): the event after its kernels on the buffer's stream.
  PyEvent(std::shared_ptr<ep::EpBuffer> buf, std::shared_ptr<engine::device::Event> ev, bool cuda)
      : buf_(std::move(buf)), ev_(std::move(ev)), cuda_(cuda) {}
  ~PyEvent();
  // Waits on the host; raises the operation's error (a stream call's, or an earlier one's).
  void wait() {
    py::gil_scoped_release nogil;
    if (e_) return e_->wait();
    Status st = ev_->wait(engine::noDeadline());
    if (!st.ok()) throw std::runtime_error("ep event: the kernels failed: " + st.toString());
    buf_->checkStreamCalls();
  }
  // DeepEP's: the caller's current stream waits for the operation (CPU tensors have no
  // stream: there it waits on the host).
  void currentStreamWait() {
    if (e_) return wait();
    const void* s = callerStream(cuda_, buf_->device(), "ep event");
    py::gil_scoped_release nogil;
    buf_->streamWait(s, *ev_, "ep event");
  }
  bool done() const { return e_ ? e_->done() : ev_->done(); }

 private:
  std::shared_ptr<ep::EpEvent> e_;
  std::shared_ptr<ep::EpBuffer> buf_;
  std::shared_ptr<engine::device::Event> ev_;
  bool cuda_ = false;
};

// Drops a reference to the buffer without the GIL when this thread holds it: the last one
// joins the buffer's worker, whose tasks may release tensors (which can need the GIL).
inline void dropBuffer(std::shared_ptr<ep::EpBuffer>& b) {
  if (PyGILState_Check()) {
    py::gil_scoped_release nogil;
    b.reset();
  } else {
    b.reset();
  }
}

inline PyEvent::~PyEvent() {
  if (buf_) dropBuffer(buf_);
}

// hook(): completes the receive half of an operation (once). on_drop: run instead when the
// hook is dropped without being called.
class PyHook {
 public:
  PyHook(std::shared_ptr<ep::EpBuffer> buf, std::function<void()> recv,
         std::function<void()> on_drop = nullptr)
      : buf_(std::move(buf)), recv_(std::move(recv)), on_drop_(std::move(on_drop)) {}
  ~PyHook() {
    if (recv_ && on_drop_) {  // (without the GIL: it takes the buffer's lock)
      if (PyGILState_Check()) {
        py::gil_scoped_release nogil;
        on_drop_();
      } else {
        on_drop_();
      }
    }
    dropBuffer(buf_);
  }
  void call() {
    if (!recv_) throw std::runtime_error("ep hook: already called");
    auto fn = std::move(recv_);
    recv_ = nullptr;
    py::gil_scoped_release nogil;
    buf_->runSync(fn);
  }

 private:
  std::shared_ptr<ep::EpBuffer> buf_;
  std::function<void()> recv_;
  std::function<void()> on_drop_;
};

}  // namespace mooncake::torch_ext::ep_py
