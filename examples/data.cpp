#include "examples/data.h"

#include <fstream>
#include <iterator>
#include <random>
#include <utility>

#include <fmt/format.h>

#include "runtime/error.h"

namespace strata::examples {
namespace {

// The synthetic language: sentences with agreement, fixed phrases and word arithmetic, so a
// model can learn spelling, then syntax, then a little arithmetic: the loss keeps falling.
const std::vector<std::string> kNouns = {"cat",   "dog",   "bird",  "river", "city",  "king",
                                         "queen", "horse", "tree",  "ship",  "child", "stone",
                                         "house", "wolf",  "garden", "lamp"};
const std::vector<std::string> kAdjectives = {"old",   "small", "bright", "quiet", "red",
                                              "green", "brave", "tired",  "happy", "dark"};
const std::vector<std::string> kVerbs = {"sees", "finds", "likes", "follows", "helps", "hears"};
const std::vector<std::string> kNames = {"Ada", "Alan", "Grace", "Linus", "Edsger", "Barbara"};
const std::vector<std::string> kPlaces = {"near the", "behind the", "under the", "beside the"};
const std::vector<std::string> kNumbers = {"zero", "one", "two",   "three", "four",
                                           "five", "six", "seven", "eight", "nine"};

template <class Rng>
const std::string& pick(Rng& rng, const std::vector<std::string>& words) {
  return words[std::uniform_int_distribution<size_t>(0, words.size() - 1)(rng)];
}

template <class Rng>
std::string sentence(Rng& rng) {
  switch (std::uniform_int_distribution<int>(0, 3)(rng)) {
    case 0:
      return "the " + pick(rng, kAdjectives) + " " + pick(rng, kNouns) + " " + pick(rng, kVerbs) +
             " the " + pick(rng, kNouns) + ". ";
    case 1:
      return pick(rng, kNames) + " " + pick(rng, kVerbs) + " a " + pick(rng, kNouns) + " " +
             pick(rng, kPlaces) + " " + pick(rng, kNouns) + ". ";
    case 2: {
      std::uniform_int_distribution<int> digit(0, 4);
      const int a = digit(rng), b = digit(rng);
      return kNumbers[a] + " plus " + kNumbers[b] + " is " + kNumbers[a + b] + ". ";
    }
    default: {
      const auto& noun = pick(rng, kNouns);
      return "every " + noun + " is a " + noun + ", and the " + noun + " " + pick(rng, kVerbs) +
             " " + pick(rng, kNames) + ". ";
    }
  }
}

}  // namespace

std::string synthetic_text(uint64_t seed, size_t bytes) {
  std::mt19937_64 rng(seed);
  std::string text;
  text.reserve(bytes + 128);
  while (text.size() < bytes) text += sentence(rng);
  text.resize(bytes);
  return text;
}

TokenData TokenData::synthetic(size_t bytes) {
  TokenData data;
  const auto text = synthetic_text(/*seed=*/20261129, bytes);
  data.bytes_.assign(text.begin(), text.end());
  data.description_ = fmt::format("built-in synthetic language, {} bytes", bytes);
  return data;
}

TokenData TokenData::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("--data {}: cannot open the file", path));
  TokenData data;
  data.bytes_.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) throw Error(fmt::format("--data {}: read error", path));
  data.description_ = fmt::format("{}, {} bytes (byte-level tokens)", path, data.bytes_.size());
  return data;
}

TokenData::Batch TokenData::batch(uint64_t seed, int64_t step, int64_t first, int64_t count,
                                  int64_t seq_len) const {
  const auto window = static_cast<size_t>(seq_len) + 1;
  if (bytes_.size() < window)
    throw Error(fmt::format("the data ({}) is shorter than one sample of {} tokens", description_,
                            window));
  auto buffer = torch::empty({count, seq_len + 1}, torch::kLong);
  auto* out = buffer.data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    // A sample's offset depends only on (seed, step, global sample index).
    std::seed_seq seq{seed, static_cast<uint64_t>(step), static_cast<uint64_t>(first + i)};
    std::mt19937_64 rng(seq);
    const size_t start = std::uniform_int_distribution<size_t>(0, bytes_.size() - window)(rng);
    for (size_t j = 0; j < window; ++j) out[i * window + j] = bytes_[start + j];
  }
  return {buffer.narrow(1, 0, seq_len).contiguous(), buffer.narrow(1, 1, seq_len).contiguous()};
}

TokenFiles parse_token_files(const std::string& data) {
  TokenFiles t;
  for (const auto& [prefix, width] : {std::pair<std::string, int64_t>{"tokens:", 2}, {"tokens32:", 4}}) {
    if (data.rfind(prefix, 0) != 0) continue;
    t.token_bytes = width;
    std::string rest = data.substr(prefix.size());
    for (size_t at = 0; at <= rest.size();) {
      const size_t comma = rest.find(',', at);
      const auto file = rest.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
      if (file.empty())
        throw Error(fmt::format("--data {}: an empty file name; give {}A.bin[,B.bin...]", data, prefix));
      t.files.push_back(file);
      if (comma == std::string::npos) break;
      at = comma + 1;
    }
  }
  return t;
}

}  // namespace strata::examples
