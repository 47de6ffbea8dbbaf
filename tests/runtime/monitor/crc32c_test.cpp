// CRC32C against published vectors (RFC 3720 appendix B.4, the "check" value of the CRC
// catalogue) and against a bit-at-a-time implementation; TFRecord's mask against TensorBoard's.
#include <gtest/gtest.h>

#include <random>
#include <string>

#include "runtime/monitor/event_file.h"
#include "runtime/util/crc32c.h"
#include "tests/runtime/monitor/event_reader.h"

namespace strata::monitor {
namespace {

std::string bytes(std::initializer_list<int> values) {
  std::string s;
  for (int v : values) s.push_back(static_cast<char>(v));
  return s;
}

TEST(Crc32c, KnownVectors) {
  EXPECT_EQ(crc32c(""), 0x00000000u);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c("a"), 0xC1D04330u);
  EXPECT_EQ(crc32c("The quick brown fox jumps over the lazy dog"), 0x22620404u);
}

TEST(Crc32c, Rfc3720Vectors) {
  std::string zeros(32, '\0'), ones(32, '\xff'), up, down;
  for (int i = 0; i < 32; ++i) {
    up.push_back(static_cast<char>(i));
    down.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc32c(zeros), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones), 0x62A8AB43u);
  EXPECT_EQ(crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(crc32c(down), 0x113FDB5Cu);
  // An iSCSI read command PDU.
  std::string pdu = bytes({0x01, 0xc0, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
                           0x00, 0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x00, 0x00, 0x04, 0x00,
                           0x00, 0x00, 0x00, 0x14, 0x00, 0x00, 0x00, 0x18, 0x28, 0x00, 0x00, 0x00,
                           0x00, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00});
  ASSERT_EQ(pdu.size(), 48u);
  EXPECT_EQ(crc32c(pdu), 0xD9963A56u);
}

TEST(Crc32c, MatchesBitwiseAndExtends) {
  std::mt19937 rng(7);
  for (size_t n : {1u, 3u, 8u, 255u, 256u, 1000u, 4099u}) {
    std::string data(n, '\0');
    for (char& c : data) c = static_cast<char>(rng());
    uint32_t whole = crc32c(data);
    EXPECT_EQ(whole, test::bitwise_crc32c(data)) << "n = " << n;
    for (size_t cut : {size_t(0), n / 3, n - 1, n}) {
      uint32_t first = crc32c(data.data(), cut);
      EXPECT_EQ(crc32c_extend(first, data.data() + cut, n - cut), whole) << "n = " << n << ", cut = " << cut;
    }
  }
}

TEST(Crc32c, MaskMatchesTensorBoard) {
  // masked_crc32c from tensorboard.compat.tensorflow_stub.pywrap_tensorflow.
  EXPECT_EQ(mask_crc(crc32c("123456789")), 0xC78AB0E5u);
  EXPECT_EQ(mask_crc(crc32c(std::string(8, '\0'))), 0x07980329u);
  EXPECT_EQ(mask_crc(crc32c("")), 0xA282EAD8u);
}

}  // namespace
}  // namespace strata::monitor
