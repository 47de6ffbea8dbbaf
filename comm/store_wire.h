// The rendezvous store's wire protocol, shared by its server (store_server.cpp) and its client
// (store.cpp). Only processes that hold the job's secret (STRATA_JOB_SECRET) may use the store;
// the secret itself never crosses the network.
//
// Handshake, three fixed-size messages (a peer that sends anything else is dropped):
//   server -> client  kMagic, Ns                 (Ns, Nc: 32 random bytes each)
//   client -> server  kMagic, Nc, HMAC(K, "client" Ns Nc)
//   server -> client  HMAC(K, "server" Ns Nc)    (the client checks that the server knows K too)
//                     or kWrongSecret, then close (a wrong answer is told apart from a store too
//                     crowded to hear it, which closes without a word: that client tries again)
// Both then sign with the session key S = HMAC(K, "session" Ns Nc). Each later message is a frame
//   u32 length (little-endian, at most kMaxPayload), payload, HMAC(S, dir seq length payload)
// where dir is 'C' (client to server) or 'S' and seq counts that direction's frames from 0: a
// frame cannot be forged, replayed, reordered or reflected, so a connection cannot be hijacked.
// Traffic is authenticated, not encrypted: keys and values are readable on the wire.
//
// Requests: 'S' key value -> 0 | 'G' key -> 0 value (answered once the key exists) |
// 'A' key i64 -> 0 i64 | 'C' n key... -> 0 u8. A reply starting with 1 carries an error text.
// Strings are u32 length + bytes; integers little-endian.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "comm/hmac.h"

namespace strata::comm::detail::wire {

constexpr char kMagic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 'S', '1'};
constexpr size_t kNonce = 32;
constexpr size_t kMac = 32;
constexpr size_t kServerHello = sizeof kMagic + kNonce;        // 40
constexpr size_t kClientAnswer = sizeof kMagic + kNonce + kMac;  // 72
constexpr size_t kServerProof = kMac;
// Said instead of the proof to a client whose answer does not prove the secret.
constexpr char kWrongSecret[kServerProof + 1] = "STRATA: wrong STRATA_JOB_SECRET";
constexpr uint32_t kMaxPayload = 16u << 20;  // a frame past this drops the connection
constexpr size_t kHeader = 4;

std::string client_proof(const std::string& secret, const std::string& ns, const std::string& nc);
std::string server_proof(const std::string& secret, const std::string& ns, const std::string& nc);
std::string session_key(const std::string& secret, const std::string& ns, const std::string& nc);

// A whole frame (header, payload, MAC) for `payload`, the `seq`th in direction `dir`.
std::string seal(const std::string& key, char dir, uint64_t seq, const std::string& payload);
// The MAC a frame must carry.
Digest frame_mac(const std::string& key, char dir, uint64_t seq, const char* payload,
                 uint32_t length);

uint32_t get_u32(const char* p);
void put_u32(std::string& out, uint32_t v);
void put_i64(std::string& out, int64_t v);
void put_string(std::string& out, const std::string& s);

// Reads a request or reply field by field; any read past the end sets `bad`.
class Reader {
 public:
  explicit Reader(const std::string& data) : data_(data) {}
  uint8_t u8();
  uint32_t u32();
  int64_t i64();
  std::string str();
  bool bad() const { return bad_; }
  bool done() const { return !bad_ && at_ == data_.size(); }

 private:
  const std::string& data_;
  size_t at_ = 0;
  bool bad_ = false;
};

}  // namespace strata::comm::detail::wire
