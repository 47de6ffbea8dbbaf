// The rendezvous store (issue 35): HMAC-SHA256 (libcrypto's, issue 52) against RFC 4231, then
// the store with a secret, served in this process, against hostile raw TCP peers: no secret, a
// wrong secret, silence, an oversized message, a forged and a replayed frame. Each is dropped and
// named on stderr; none reads or writes a key; a rank with the secret is not disturbed. The store
// listens on the master address only.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <thread>

#include "comm/env.h"
#include "comm/hmac.h"
#include "comm/process_group.h"
#include "comm/store.h"
#include "runtime/error.h"
#include "store_raw_client.h"

namespace strata::test {
namespace {

using comm::detail::hmac_sha256;
using comm::detail::Hmac;
using comm::detail::Store;
using comm::detail::StoreAuth;
using comm::detail::to_hex;

std::string hex_of(const comm::detail::Digest& d) { return to_hex(d.data(), d.size()); }

std::string unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out += char(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// RFC 4231, test cases 1-4, 6 and 7 (5 truncates the output).
TEST(HmacSha256, Rfc4231Vectors) {
  EXPECT_EQ(hex_of(hmac_sha256(std::string(20, '\x0b'), "Hi There")),
            "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  EXPECT_EQ(hex_of(hmac_sha256("Jefe", "what do ya want for nothing?")),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_EQ(hex_of(hmac_sha256(std::string(20, '\xaa'), std::string(50, '\xdd'))),
            "773ea91e36800e46854db8ebd09181a72959098b3ef8c122d9635514ced565fe");
  EXPECT_EQ(hex_of(hmac_sha256(unhex("0102030405060708090a0b0c0d0e0f10111213141516171819"),
                               std::string(50, '\xcd'))),
            "82558a389a443c0ea4cc819899f2083a85f0faa3e578f8077a2e3ff46729665b");
  EXPECT_EQ(hex_of(hmac_sha256(std::string(131, '\xaa'),
                               "Test Using Larger Than Block-Size Key - Hash Key First")),
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  EXPECT_EQ(hex_of(hmac_sha256(std::string(131, '\xaa'),
                               "This is a test using a larger than block-size key and a larger "
                               "than block-size data. The key needs to be hashed before being "
                               "used by the HMAC algorithm.")),
            "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

// The store feeds its MACs in parts (label, nonces; header, payload): parts of any size, a key
// longer than SHA-256's block and an empty one give the one-shot digest.
TEST(HmacSha256, FedInPiecesEqualsOneShot) {
  std::string message;
  for (int i = 0; i < 100000; ++i) message += char('a' + i % 26);
  for (const std::string& key : {std::string(), std::string("k"), std::string(200, '\x5c')}) {
    Hmac h(key);
    size_t fed = 0;
    for (size_t piece = 0; fed < message.size(); piece = (piece * 7 + 3) % 997) {
      const size_t n = std::min(piece, message.size() - fed);
      h.update(message.data() + fed, n);
      fed += n;
    }
    EXPECT_EQ(hex_of(h.finish()), hex_of(hmac_sha256(key, message))) << "key of " << key.size();
  }
  // The empty key and message (libcrypto is handed a non-null key pointer for it).
  EXPECT_EQ(hex_of(hmac_sha256("", "")),
            "b613679a0814d9ec772f95d778c35fc5ff1697c493715653c6c712144292c5ad");
}

const std::string kSecret = "test-secret-0123456789abcdef";
constexpr auto kTimeout = std::chrono::seconds(20);

class SecretStore : public ::testing::Test {
 protected:
  void SetUp() override {
    StoreAuth auth{kSecret, false, std::chrono::milliseconds(500)};
    server_ = Store::open("127.0.0.1", 0, true, kTimeout, auth);
    client_ = Store::open("127.0.0.1", server_->port(), false, kTimeout, auth);
  }
  int port() const { return server_->port(); }

  std::unique_ptr<Store> server_, client_;
};

TEST_F(SecretStore, RanksWithTheSecretSetGetAddCheckAndWait) {
  server_->set("a", std::string("x\0y", 3));
  EXPECT_EQ(client_->get("a"), std::string("x\0y", 3));
  EXPECT_TRUE(client_->check({"a"}));
  EXPECT_FALSE(client_->check({"a", "b"}));
  EXPECT_EQ(client_->add("n", 5), 5);
  EXPECT_EQ(server_->add("n", -2), 3);
  EXPECT_EQ(server_->get("n"), "3");
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    server_->set("late", "v");
  });
  EXPECT_EQ(client_->get("late"), "v");  // waits on the server for the key
  later.join();
  EXPECT_TRUE(client_->wait_for({"a", "late"}, std::chrono::seconds(1)));
  EXPECT_FALSE(client_->wait_for({"never"}, std::chrono::milliseconds(20)));
  EXPECT_THROW(client_->add("a", 1), Error);  // not a number; the connection stays usable
  EXPECT_EQ(client_->get("a"), std::string("x\0y", 3));
}

// What the store said on stderr while `f` ran.
template <class F>
std::string stderr_of(F&& f) {
  ::testing::internal::CaptureStderr();
  f();
  return ::testing::internal::GetCapturedStderr();
}

TEST_F(SecretStore, HostilePeersAreDroppedAndNamedWhileRanksGoOn) {
  const std::string said = stderr_of([&] {
    // No secret (as a client of an open store would speak), then a wrong one: the server says
    // so instead of proving itself and closes, and a request sealed afterwards is never answered.
    for (const std::string& secret : {std::string(), std::string("wrong-secret-0123456789")}) {
      RawClient c;
      ASSERT_TRUE(c.connect("127.0.0.1", port()));
      EXPECT_EQ(c.handshake(secret), std::string(wire::kWrongSecret, wire::kServerProof))
          << "a server proof for secret '" << secret << "'";
      c.send_request(RawClient::set_request("stolen", "1"));
      EXPECT_TRUE(c.closed_within(2));
    }
    // Silence: dropped after the authentication timeout (0.5 s here).
    {
      RawClient c;
      ASSERT_TRUE(c.connect("127.0.0.1", port()));
      EXPECT_EQ(c.receive(wire::kServerHello, 2).size(), wire::kServerHello);
      const auto start = std::chrono::steady_clock::now();
      EXPECT_TRUE(c.closed_within(5));
      EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(400));
    }
    // A megabyte in place of the handshake: dropped at its first wrong byte.
    {
      RawClient c;
      ASSERT_TRUE(c.connect("127.0.0.1", port()));
      EXPECT_EQ(c.receive(wire::kServerHello, 2).size(), wire::kServerHello);
      c.send(std::string(1 << 20, 'A'));
      EXPECT_TRUE(c.closed_within(2));
    }
    // With the secret, a frame announcing 1 GiB: dropped at the header, nothing allocated.
    {
      RawClient c;
      ASSERT_TRUE(c.connect("127.0.0.1", port()));
      EXPECT_EQ(c.handshake(kSecret).size(), wire::kServerProof);
      std::string header;
      wire::put_u32(header, 1u << 30);
      c.send(header + std::string(1000, 'x'));
      EXPECT_TRUE(c.closed_within(2));
    }
    // With the secret, a forged frame (wrong MAC) and a replayed one: dropped, unanswered.
    {
      RawClient c;
      ASSERT_TRUE(c.connect("127.0.0.1", port()));
      ASSERT_EQ(c.handshake(kSecret).size(), wire::kServerProof);
      std::string frame = wire::seal(c.session, 'C', 0, RawClient::set_request("forged", "1"));
      frame[frame.size() - 1] ^= 1;
      c.send(frame);
      EXPECT_TRUE(c.closed_within(2));
    }
    {
      RawClient c;
      ASSERT_TRUE(c.connect("127.0.0.1", port()));
      ASSERT_EQ(c.handshake(kSecret).size(), wire::kServerProof);
      const std::string frame = wire::seal(c.session, 'C', 0, RawClient::get_request("k"));
      c.send(frame);  // answered once "k" exists
      c.send(frame);  // the same frame again: seq 0 twice
      server_->set("k", "v");
      const std::string reply = c.receive(100, 2);
      EXPECT_FALSE(reply.empty());  // the genuine get is answered...
      EXPECT_TRUE(c.closed_within(2));  // ...the replay drops the connection
    }
  });
  EXPECT_FALSE(client_->check({"stolen"}));
  EXPECT_FALSE(client_->check({"forged"}));
  client_->set("after", "ok");  // the rank's connection is untouched
  EXPECT_EQ(server_->get("after"), "ok");
  EXPECT_NE(said.find("refused 127.0.0.1:"), std::string::npos) << said;
  EXPECT_NE(said.find("does not know the job's secret (STRATA_JOB_SECRET)"), std::string::npos)
      << said;
  EXPECT_NE(said.find("did not authenticate within 0.5 s"), std::string::npos) << said;
  EXPECT_NE(said.find("does not speak the store's protocol"), std::string::npos) << said;
  EXPECT_NE(said.find("a message of 1073741824 bytes, over the limit of 16777216"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("MAC is wrong"), std::string::npos) << said;
  EXPECT_EQ(said.find(kSecret), std::string::npos) << said;
}

TEST_F(SecretStore, AWrongSecretIsRefusedByNameWithoutShowingEither) {
  const std::string wrong = "another-secret-0123456789";
  std::string said;
  try {
    stderr_of([&] {
      Store::open("127.0.0.1", port(), false, std::chrono::seconds(5), StoreAuth{wrong});
    });
    ADD_FAILURE() << "joined with a wrong secret";
  } catch (const Error& e) {
    said = e.what();
  }
  EXPECT_NE(said.find("the ranks do not share one STRATA_JOB_SECRET"), std::string::npos) << said;
  EXPECT_EQ(said.find(wrong), std::string::npos) << said;
  EXPECT_EQ(said.find(kSecret), std::string::npos) << said;
}

// The store listens on the master's address only: 127.0.0.2 is this machine too, but refused.
TEST_F(SecretStore, IsNotReachableOnAnotherAddress) {
  RawClient other;
  EXPECT_FALSE(other.connect("127.0.0.2", port()));
  RawClient master;
  EXPECT_TRUE(master.connect("127.0.0.1", port()));
}

TEST(StoreListen, EveryInterfaceWhenAsked) {
  StoreAuth auth{kSecret, true};
  auto server = Store::open("127.0.0.1", 0, true, kTimeout, auth);
  RawClient other;
  EXPECT_TRUE(other.connect("127.0.0.2", server->port()));
}

TEST(StoreListen, LoopbackNamesAreKnownAndLiteralsAreNot) {
  EXPECT_EQ(comm::detail::loopback_name("127.0.0.1"), "");
  EXPECT_EQ(comm::detail::loopback_name("::1"), "");
  const std::string localhost = comm::detail::loopback_name("localhost");
  EXPECT_TRUE(localhost == "127.0.0.1" || localhost == "::1") << localhost;
}

TEST(StoreAccess, ReadsTheSecretAndRefusesAShortOneWithoutShowingIt) {
  auto env = [](std::map<std::string, std::string> vars) -> comm::EnvLookup {
    return [vars](const std::string& name) -> std::optional<std::string> {
      auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    };
  };
  const comm::StoreAccess a = comm::read_store_access(
      env({{"STRATA_JOB_SECRET", kSecret}, {"STRATA_STORE_LISTEN_ALL", "1"},
           {"STRATA_STORE_AUTH_TIMEOUT", "2.5"}}));
  EXPECT_EQ(a.secret, kSecret);
  EXPECT_TRUE(a.listen_all);
  EXPECT_EQ(a.auth_timeout, std::chrono::milliseconds(2500));
  try {
    comm::read_store_access(env({{"STRATA_JOB_SECRET", "short-one"}}));
    ADD_FAILURE() << "a 9-character secret was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("STRATA_JOB_SECRET has 9 characters"), std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find("short-one"), std::string::npos) << e.what();
  }
  EXPECT_THROW(comm::read_store_access(env({{"STRATA_STORE_LISTEN_ALL", "yes"}})), Error);
}

}  // namespace
}  // namespace strata::test

namespace strata::test {
namespace {

// Rank 0 of a job whose ranks span hosts (LOCAL_WORLD_SIZE < WORLD_SIZE) refuses a master that is
// a name for this host's loopback, naming it, before it listens where no other host can reach.
TEST(StoreListen, AMasterNameForTheLoopbackIsRefusedWhenRanksSpanHosts) {
  comm::InitOptions options;
  comm::RankEnv env;
  env.rank = 0;
  env.world_size = 2;
  env.local_world_size = 1;
  env.master_addr = "localhost";
  env.master_port = 0;
  env.convention = "torchrun";
  options.env = env;
  options.timeout_s = 5;
  try {
    comm::init_process_group(options);
    ADD_FAILURE() << "rank 0 listened on a loopback name with ranks on other hosts";
  } catch (const Error& e) {
    const std::string said = e.what();
    EXPECT_NE(said.find("MASTER_ADDR 'localhost' resolves to "), std::string::npos) << said;
    EXPECT_NE(said.find("a loopback address (as Debian's /etc/hosts maps the host's own name to "
                        "127.0.1.1), but the job has ranks on other hosts"),
              std::string::npos)
        << said;
  }
}

}  // namespace
}  // namespace strata::test
