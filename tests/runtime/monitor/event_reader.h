// An independent reader of TensorBoard event files for the tests: TFRecord framing with both
// CRCs checked by a bit-at-a-time CRC32C (not the table-driven one under test), and a generic
// protobuf field decoder. Malformed input fails the test with a message.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

namespace strata::test {

// CRC32C one bit at a time, straight from the definition (reflected polynomial 0x82F63B78).
inline uint32_t bitwise_crc32c(const std::string& bytes) {
  uint32_t crc = 0xffffffffu;
  for (unsigned char byte : bytes) {
    crc ^= byte;
    for (int i = 0; i < 8; ++i) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
  }
  return crc ^ 0xffffffffu;
}

inline uint32_t masked(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + 0xa282ead8u; }

inline uint64_t read_le(const std::string& s, size_t pos, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= uint64_t(static_cast<unsigned char>(s[pos + i])) << (8 * i);
  return v;
}

inline std::string slurp_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The data of each TFRecord in `file`; checks both masked CRCs and that nothing trails.
inline std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> records;
  size_t pos = 0;
  while (pos < file.size()) {
    if (file.size() - pos < 12) {
      ADD_FAILURE() << "truncated record header at byte " << pos;
      break;
    }
    uint64_t length = read_le(file, pos, 8);
    uint32_t length_crc = static_cast<uint32_t>(read_le(file, pos + 8, 4));
    EXPECT_EQ(length_crc, masked(bitwise_crc32c(file.substr(pos, 8)))) << "length CRC at byte " << pos;
    if (file.size() - pos - 12 < length + 4) {
      ADD_FAILURE() << "truncated record data at byte " << pos;
      break;
    }
    std::string data = file.substr(pos + 12, length);
    uint32_t data_crc = static_cast<uint32_t>(read_le(file, pos + 12 + length, 4));
    EXPECT_EQ(data_crc, masked(bitwise_crc32c(data))) << "data CRC at byte " << pos;
    records.push_back(std::move(data));
    pos += 12 + length + 4;
  }
  return records;
}

// One protobuf field: its number, wire type and value (varint / fixed bits, or bytes).
struct ProtoField {
  uint32_t number = 0;
  uint32_t wire_type = 0;
  uint64_t bits = 0;
  std::string bytes;
};

inline std::vector<ProtoField> decode_proto(const std::string& msg) {
  std::vector<ProtoField> fields;
  size_t pos = 0;
  auto varint = [&](uint64_t& out) {
    out = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos >= msg.size()) return false;
      auto b = static_cast<unsigned char>(msg[pos++]);
      out |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return true;
    }
    return false;
  };
  while (pos < msg.size()) {
    uint64_t key;
    if (!varint(key)) {
      ADD_FAILURE() << "bad field key";
      break;
    }
    ProtoField f;
    f.number = static_cast<uint32_t>(key >> 3);
    f.wire_type = static_cast<uint32_t>(key & 7);
    bool ok = true;
    switch (f.wire_type) {
      case 0: ok = varint(f.bits); break;
      case 1: ok = pos + 8 <= msg.size(); if (ok) f.bits = read_le(msg, pos, 8); pos += 8; break;
      case 5: ok = pos + 4 <= msg.size(); if (ok) f.bits = read_le(msg, pos, 4); pos += 4; break;
      case 2: {
        uint64_t n;
        ok = varint(n) && pos + n <= msg.size();
        if (ok) f.bytes = msg.substr(pos, n);
        pos += n;
        break;
      }
      default: ok = false;
    }
    if (!ok) {
      ADD_FAILURE() << "bad field " << f.number << " (wire type " << f.wire_type << ")";
      break;
    }
    fields.push_back(std::move(f));
  }
  return fields;
}

// An Event proto, decoded by field number (event.proto / summary.proto).
struct DecodedEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::optional<std::string> file_version;
  struct Value {
    std::string tag;
    float simple_value = 0;
  };
  std::vector<Value> values;
};

inline DecodedEvent decode_event(const std::string& record) {
  DecodedEvent e;
  for (const ProtoField& f : decode_proto(record)) {
    if (f.number == 1 && f.wire_type == 1) {
      std::memcpy(&e.wall_time, &f.bits, 8);
    } else if (f.number == 2 && f.wire_type == 0) {
      e.step = static_cast<int64_t>(f.bits);
    } else if (f.number == 3 && f.wire_type == 2) {
      e.file_version = f.bytes;
    } else if (f.number == 5 && f.wire_type == 2) {
      for (const ProtoField& v : decode_proto(f.bytes)) {
        EXPECT_EQ(v.number, 1u);
        EXPECT_EQ(v.wire_type, 2u);
        DecodedEvent::Value value;
        for (const ProtoField& vf : decode_proto(v.bytes)) {
          if (vf.number == 1 && vf.wire_type == 2) {
            value.tag = vf.bytes;
          } else if (vf.number == 2 && vf.wire_type == 5) {
            uint32_t bits = static_cast<uint32_t>(vf.bits);
            std::memcpy(&value.simple_value, &bits, 4);
          } else {
            ADD_FAILURE() << "unexpected Summary.Value field " << vf.number;
          }
        }
        e.values.push_back(value);
      }
    } else {
      ADD_FAILURE() << "unexpected Event field " << f.number << " (wire type " << f.wire_type << ")";
    }
  }
  return e;
}

inline std::vector<DecodedEvent> read_event_file(const std::string& path) {
  std::vector<DecodedEvent> events;
  for (const std::string& r : read_records(slurp_file(path))) events.push_back(decode_event(r));
  return events;
}

}  // namespace strata::test
