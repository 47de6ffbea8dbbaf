#include "comm/store_wire.h"

namespace strata::comm::detail::wire {
namespace {

std::string mac_of(const std::string& secret, const char* label, const std::string& ns,
                   const std::string& nc) {
  Hmac h(secret);
  h.update(label);
  h.update(ns);
  h.update(nc);
  const Digest d = h.finish();
  return std::string(reinterpret_cast<const char*>(d.data()), d.size());
}

}  // namespace

// The labels differ in their first byte, so no proof can stand in for another.
std::string client_proof(const std::string& secret, const std::string& ns, const std::string& nc) {
  return mac_of(secret, "client", ns, nc);
}
std::string server_proof(const std::string& secret, const std::string& ns, const std::string& nc) {
  return mac_of(secret, "server", ns, nc);
}
std::string session_key(const std::string& secret, const std::string& ns, const std::string& nc) {
  return mac_of(secret, "session", ns, nc);
}

uint32_t get_u32(const char* p) {
  const auto* u = reinterpret_cast<const uint8_t*>(p);
  return uint32_t(u[0]) | uint32_t(u[1]) << 8 | uint32_t(u[2]) << 16 | uint32_t(u[3]) << 24;
}

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out += char(uint8_t(v >> (8 * i)));
}

void put_i64(std::string& out, int64_t v) {
  for (int i = 0; i < 8; ++i) out += char(uint8_t(uint64_t(v) >> (8 * i)));
}

void put_string(std::string& out, const std::string& s) {
  put_u32(out, uint32_t(s.size()));
  out += s;
}

Digest frame_mac(const std::string& key, char dir, uint64_t seq, const char* payload,
                 uint32_t length) {
  Hmac h(key);
  std::string head(1, dir);
  put_i64(head, int64_t(seq));
  put_u32(head, length);
  h.update(head);
  h.update(payload, length);
  return h.finish();
}

std::string seal(const std::string& key, char dir, uint64_t seq, const std::string& payload) {
  std::string frame;
  frame.reserve(kHeader + payload.size() + kMac);
  put_u32(frame, uint32_t(payload.size()));
  frame += payload;
  const Digest mac = frame_mac(key, dir, seq, payload.data(), uint32_t(payload.size()));
  frame.append(reinterpret_cast<const char*>(mac.data()), mac.size());
  return frame;
}

uint8_t Reader::u8() {
  if (bad_ || at_ + 1 > data_.size()) return bad_ = true, 0;
  return uint8_t(data_[at_++]);
}

uint32_t Reader::u32() {
  if (bad_ || at_ + 4 > data_.size()) return bad_ = true, 0;
  const uint32_t v = get_u32(data_.data() + at_);
  at_ += 4;
  return v;
}

int64_t Reader::i64() {
  if (bad_ || at_ + 8 > data_.size()) return bad_ = true, 0;
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= uint64_t(uint8_t(data_[at_ + size_t(i)])) << (8 * i);
  at_ += 8;
  return int64_t(v);
}

std::string Reader::str() {
  const uint32_t n = u32();
  if (bad_ || at_ + n > data_.size()) return bad_ = true, std::string();
  std::string s = data_.substr(at_, n);
  at_ += n;
  return s;
}

}  // namespace strata::comm::detail::wire
