// Bounds-checked little-endian codec for everything the engine puts on a wire or in a
// rendezvous blob. A Reader never reads past its buffer: any short or malformed input sets
// the error flag and every later read returns zero values, so decoders check ok() once.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

namespace mooncake::wire {

class Writer {
 public:
  void u8(uint8_t v) { buf_.push_back(static_cast<char>(v)); }
  void u16(uint16_t v) { raw(&v, 2); }
  void u32(uint32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void i32(int32_t v) { raw(&v, 4); }
  void str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    buf_.append(s.data(), s.size());
  }
  void raw(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }
  std::string& data() { return buf_; }
  std::string take() { return std::move(buf_); }

 private:
  std::string buf_;
};

class Reader {
 public:
  explicit Reader(std::string_view in) : in_(in) {}
  uint8_t u8() { uint8_t v = 0; raw(&v, 1); return v; }
  uint16_t u16() { uint16_t v = 0; raw(&v, 2); return v; }
  uint32_t u32() { uint32_t v = 0; raw(&v, 4); return v; }
  uint64_t u64() { uint64_t v = 0; raw(&v, 8); return v; }
  int32_t i32() { int32_t v = 0; raw(&v, 4); return v; }
  // Strings longer than max_len are malformed (protects against absurd lengths).
  std::string str(uint32_t max_len = 1u << 20) {
    uint32_t n = u32();
    if (!ok_ || n > max_len || n > remaining()) { ok_ = false; return {}; }
    std::string s(in_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  void raw(void* p, size_t n) {
    if (!ok_ || n > remaining()) { ok_ = false; std::memset(p, 0, n); return; }
    std::memcpy(p, in_.data() + pos_, n);
    pos_ += n;
  }
  size_t remaining() const { return in_.size() - pos_; }
  bool ok() const { return ok_; }
  bool done() const { return ok_ && pos_ == in_.size(); }
  void fail() { ok_ = false; }

 private:
  std::string_view in_;
  size_t pos_ = 0;
  bool ok_ = true;
};

}  // namespace mooncake::wire
