// Hugging Face folders (hf_folder.h) and the import into a module (import_weights.h): sharded
// folders written and read back by range with dtype conversion; a model built inside a
// PartitionedInit takes exactly the shards the whole import would give it; fused and stacked
// layouts; and hostile folders (a truncated shard, an index naming a missing file or a path
// outside the folder, header offsets out of range, a dtype the model cannot take, names missing,
// unexpected or mis-shaped) refused by name with the model left exactly as it was.
#include <fstream>
#include <map>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/hf_folder.h"
#include "runtime/checkpoint/import_weights.h"
#include "runtime/error.h"
#include "tests/runtime/checkpoint/scratch_dir.h"
#include "tests/runtime/checkpoint/test_util.h"
#include "zero/partitioned_init.h"

namespace ckpt = strata::checkpoint;
using strata::test::ScratchDir;
using strata::test::error_of;
using strata::test::same_bits;
using strata::test::write_bytes;

namespace {

// A model with the shapes a decoder has: a fused q/k/v (the file's split), a stack of experts
// (the file's per expert), a norm, a buffer.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    embed = register_parameter("embed", torch::randn({50, 24}));
    qkv = register_parameter("qkv", torch::randn({24 + 8 + 8, 24}));
    experts = register_parameter("experts", torch::randn({3, 16, 24}));
    norm = register_parameter("norm", torch::ones({24}));
    steps = register_buffer("steps", torch::zeros({2}, torch::kLong));
  }
  torch::Tensor embed, qkv, experts, norm, steps;
};
TORCH_MODULE(Net);

ckpt::ImportOptions net_map() {
  ckpt::ImportOptions o;
  o.fused = {{"qkv", {"attn.q.weight", "attn.k.weight", "attn.v.weight"}, {}},
             {"experts", {"moe.0.w1", "moe.1.w1", "moe.2.w1"}, {}}};
  return o;
}

// The file's tensors for `values` (a Net's): q/k/v split, experts one by one.
std::vector<std::pair<std::string, torch::Tensor>> file_tensors(Net& values, torch::ScalarType dtype) {
  return {{"embed", values->embed.to(dtype)},
          {"attn.q.weight", values->qkv.narrow(0, 0, 24).to(dtype)},
          {"attn.k.weight", values->qkv.narrow(0, 24, 8).to(dtype)},
          {"attn.v.weight", values->qkv.narrow(0, 32, 8).to(dtype)},
          {"moe.0.w1", values->experts[0].to(dtype)},
          {"moe.1.w1", values->experts[1].to(dtype)},
          {"moe.2.w1", values->experts[2].to(dtype)},
          {"norm", values->norm.to(dtype)},
          {"steps", torch::tensor({7, 9}, torch::kLong)}};
}

void write_folder(const std::string& dir, const ckpt::NamedTensors& tensors, int64_t shard_bytes) {
  std::vector<ckpt::TensorSpec> specs;
  std::map<std::string, torch::Tensor> by_name;
  for (const auto& [n, t] : tensors) {
    specs.push_back({n, t.scalar_type(), t.sizes().vec()});
    by_name[n] = t;
  }
  ckpt::write_hf_folder(dir, specs, [&](const std::string& n) { return by_name.at(n); }, shard_bytes);
}

std::map<std::string, torch::Tensor> snapshot(Net& net) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : net->named_parameters()) out[p.key()] = p.value().clone();
  for (const auto& b : net->named_buffers()) out[b.key()] = b.value().clone();
  return out;
}

bool unchanged(Net& net, const std::map<std::string, torch::Tensor>& before) {
  for (const auto& p : net->named_parameters())
    if (!same_bits(p.value(), before.at(p.key()))) return false;
  for (const auto& b : net->named_buffers())
    if (!same_bits(b.value(), before.at(b.key()))) return false;
  return true;
}

}  // namespace

TEST(HfFolder, ShardsIndexAndRangedReadsWithConversion) {
  ScratchDir dir;
  torch::manual_seed(1);
  Net values;
  const auto tensors = file_tensors(values, torch::kBFloat16);
  write_folder(dir.str(), tensors, 3000);  // several shards; the 50 x 24 embedding alone in one
  nlohmann::json index = nlohmann::json::parse(ckpt::read_file(dir.str() + "/" + ckpt::kHfIndexFile));
  EXPECT_GT(index.at("weight_map").size(), 0u);
  std::set<std::string> shards;
  for (const auto& [n, f] : index.at("weight_map").items()) shards.insert(f.get<std::string>());
  EXPECT_GE(shards.size(), 3u);
  EXPECT_TRUE(shards.count("model-00001-of-0000" + std::to_string(shards.size()) + ".safetensors"));

  const ckpt::HfWeights weights(dir.str());
  EXPECT_EQ(weights.shard_count(), shards.size());
  EXPECT_EQ(weights.names().size(), tensors.size());
  for (const auto& [name, t] : tensors) {
    const auto* spec = weights.find(name);
    ASSERT_NE(spec, nullptr) << name;
    EXPECT_EQ(spec->dtype, t.scalar_type());
    EXPECT_EQ(spec->shape, t.sizes().vec());
    if (!t.is_floating_point()) continue;
    // A range in the middle, read as fp32: torch's own conversion, bit for bit.
    const int64_t n = t.numel(), begin = n / 3, count = n - n / 3 - 1;
    auto got = torch::empty({count}, torch::kFloat);
    weights.read(name, begin, count, torch::kFloat, got.data_ptr());
    EXPECT_TRUE(same_bits(got, t.reshape({-1}).narrow(0, begin, count).to(torch::kFloat))) << name;
  }
  // One shard: model.safetensors and no index.
  ScratchDir one;
  write_folder(one.str(), tensors, ckpt::kHfDefaultShardBytes);
  EXPECT_TRUE(std::ifstream(one.str() + "/" + ckpt::kHfWeightsFile).good());
  EXPECT_FALSE(std::ifstream(one.str() + "/" + ckpt::kHfIndexFile).good());
  EXPECT_EQ(ckpt::HfWeights(one.str()).names().size(), tensors.size());
  EXPECT_EQ(ckpt::parse_shard_size("5GB", "x"), 5'000'000'000);
  EXPECT_EQ(ckpt::parse_shard_size("2MiB", "x"), 2 << 20);
  EXPECT_NE(error_of([] { ckpt::parse_shard_size("5 GB", "--max-shard-size"); }).find("--max-shard-size"),
            std::string::npos);
}

TEST(HfFolder, ImportFusedAndStackedLayoutsWholeAndPartitioned) {
  ScratchDir dir;
  torch::manual_seed(2);
  Net values;
  write_folder(dir.str(), file_tensors(values, torch::kFloat), 2000);
  const ckpt::HfWeights weights(dir.str());

  Net whole;
  const auto r = ckpt::import_weights(*whole, weights, net_map());
  EXPECT_EQ(r.tensors, 5);
  EXPECT_TRUE(same_bits(whole->qkv, values->qkv));
  EXPECT_TRUE(same_bits(whole->experts, values->experts));
  EXPECT_TRUE(same_bits(whole->embed, values->embed));
  EXPECT_TRUE(same_bits(whole->steps, torch::tensor({7, 9}, torch::kLong)));

  // Built in shards (bf16, as a bf16 run builds it): each shard holds its elements of the file's
  // values converted, and the whole values gathered back equal the whole import cast.
  strata::zero::PartitionedInitOptions po;
  po.dtype = torch::kBFloat16;
  po.min_numel = 100;
  auto init = strata::zero::PartitionedInit::create(nullptr, po);
  Net built;
  init->finish();
  ASSERT_TRUE(init->shard_of(built->qkv).has_value());
  auto options = net_map();
  options.partitioned = init;
  const auto rp = ckpt::import_weights(*built, weights, options);
  EXPECT_EQ(rp.tensors, 5);
  for (const auto& [name, want] : std::vector<std::pair<std::string, torch::Tensor>>{
           {"qkv", values->qkv}, {"experts", values->experts}, {"embed", values->embed}}) {
    const auto& t = name == "qkv" ? built->qkv : name == "experts" ? built->experts : built->embed;
    EXPECT_TRUE(same_bits(init->full_value(t), want.to(torch::kBFloat16))) << name;
  }
  EXPECT_TRUE(same_bits(built->norm, values->norm));  // small: whole, in its own dtype
  init->release();

  // Without the scope, a partitioned model is refused, not written through freed bytes.
  auto init2 = strata::zero::PartitionedInit::create(nullptr, po);
  Net built2;
  init2->finish();
  EXPECT_NE(error_of([&] { ckpt::import_weights(*built2, weights, net_map()); })
                .find("ImportOptions::partitioned"),
            std::string::npos);
  init2->release();
}

TEST(HfFolder, WrongNamesShapesAndDtypesAreListedTogetherAndNothingIsLoaded) {
  ScratchDir dir;
  torch::manual_seed(3);
  Net values;
  auto tensors = file_tensors(values, torch::kFloat);
  for (auto& [name, t] : tensors) {
    if (name == "embed") t = torch::zeros({51, 24});            // mis-shaped
    if (name == "norm") t = torch::zeros({24}, torch::kInt);    // an int for a float
  }
  tensors.erase(tensors.begin() + 3);                             // attn.v.weight
  tensors.push_back({"lm_head.weight", torch::zeros({50, 24})});  // unexpected
  tensors.push_back({"rotary.inv_freq", torch::zeros({4})});      // ignored below
  write_folder(dir.str(), tensors, ckpt::kHfDefaultShardBytes);
  Net net;
  const auto before = snapshot(net);
  auto options = net_map();
  options.ignored = {"rotary.inv_freq"};
  const auto what = error_of([&] { ckpt::import_weights(*net, ckpt::HfWeights(dir.str()), options); });
  for (const char* expected : {"nothing was loaded", "qkv (from attn.v.weight)",
                               "lm_head.weight", "embed: the model's [50, 24], the file's [51, 24]",
                               "norm: the file's I32"})
    EXPECT_NE(what.find(expected), std::string::npos) << expected << " in:\n" << what;
  EXPECT_EQ(what.find("rotary.inv_freq"), std::string::npos) << what;
  EXPECT_TRUE(unchanged(net, before));
}

TEST(HfFolder, HostileFoldersAreRefusedByNameBeforeAnythingIsLoaded) {
  ScratchDir dir;
  torch::manual_seed(4);
  Net values;
  const auto tensors = file_tensors(values, torch::kFloat);
  const std::string good = dir.str() + "/good";
  write_folder(good, tensors, 2000);
  const auto index_text = ckpt::read_file(good + "/" + ckpt::kHfIndexFile);
  const auto index = nlohmann::json::parse(index_text);
  const std::string first_shard = index.at("weight_map").at("embed");
  const auto shard_bytes = ckpt::read_file(good + "/" + first_shard);

  // A copy of the good folder with one file replaced.
  int n = 0;
  auto variant = [&](const std::string& file, const std::string& bytes) {
    const std::string d = dir.str() + "/v" + std::to_string(n++);
    ckpt::make_directories(d);
    for (const auto& f : std::set<std::string>{first_shard, std::string(ckpt::kHfIndexFile)})
      write_bytes(d + "/" + f, ckpt::read_file(good + "/" + f));
    for (const auto& [name, f] : index.at("weight_map").items())
      write_bytes(d + "/" + f.get<std::string>(), ckpt::read_file(good + "/" + f.get<std::string>()));
    write_bytes(d + "/" + file, bytes);
    return d;
  };
  auto header_of = [&](const std::string& bytes) {
    uint64_t len = 0;
    for (int i = 0; i < 8; ++i) len |= uint64_t(uint8_t(bytes[i])) << (8 * i);
    return std::make_pair(nlohmann::json::parse(bytes.substr(8, len)), bytes.substr(8 + len));
  };
  auto with_header = [](const nlohmann::json& h, const std::string& data) {
    std::string text = h.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    std::string out;
    for (int i = 0; i < 8; ++i) out.push_back(char((uint64_t(text.size()) >> (8 * i)) & 0xff));
    return out + text + data;
  };

  std::vector<std::pair<std::string, std::string>> cases;  // folder, what the error must name
  cases.push_back({variant(first_shard, shard_bytes.substr(0, shard_bytes.size() - 5)),
                   first_shard});  // truncated shard
  {
    auto j = index;
    j["weight_map"]["embed"] = "model-00009-of-00009.safetensors";
    cases.push_back({variant(ckpt::kHfIndexFile, j.dump()), "model-00009-of-00009.safetensors"});
  }
  {
    auto j = index;
    j["weight_map"]["embed"] = "../good/" + first_shard;
    cases.push_back({variant(ckpt::kHfIndexFile, j.dump()), "not a file name inside"});
  }
  {
    auto [h, data] = header_of(shard_bytes);
    h["embed"]["data_offsets"] = {0, uint64_t(1) << 40};
    cases.push_back({variant(first_shard, with_header(h, data)), "embed"});
  }
  {
    auto [h, data] = header_of(shard_bytes);
    h["embed"]["dtype"] = "F8_E4M3";
    cases.push_back({variant(first_shard, with_header(h, data)), "F8_E4M3"});
  }
  {
    auto j = index;
    // (A shard the index does not name is not read, as transformers reads none: the tensor is
    // missing.)
    j["weight_map"].erase("embed");
    cases.push_back({variant(ckpt::kHfIndexFile, j.dump()), "missing from the files:\n    embed"});
  }
  {
    // A shard holding a tensor the index does not list: the two disagree.
    std::map<std::string, std::vector<std::string>> by_shard;
    for (const auto& [name, f] : index.at("weight_map").items()) by_shard[f.get<std::string>()].push_back(name);
    for (const auto& [f, names] : by_shard)
      if (names.size() > 1) {
        auto j = index;
        j["weight_map"].erase(names[0]);
        cases.push_back({variant(ckpt::kHfIndexFile, j.dump()), "does not list"});
        break;
      }
    EXPECT_EQ(cases.back().second, "does not list");
  }
  cases.push_back({variant(ckpt::kHfIndexFile, "{\"weight_map\": [1, 2]}"), "weight_map"});
  cases.push_back({variant(ckpt::kHfIndexFile, "{\"weight_map\": "), "not valid JSON"});
  {
    // I64 where the model holds float: readable as a file, refused by the import.
    auto [h, data] = header_of(shard_bytes);
    h["embed"]["dtype"] = "I64";
    h["embed"]["shape"] = {600};
    cases.push_back({variant(first_shard, with_header(h, data)), "I64"});
  }
  for (const auto& [folder, expected] : cases) {
    Net net;
    const auto before = snapshot(net);
    const auto what = error_of([&] { ckpt::import_weights(*net, ckpt::HfWeights(folder), net_map()); });
    EXPECT_NE(what.find(expected), std::string::npos) << folder << ": " << what;
    EXPECT_TRUE(unchanged(net, before)) << folder;
  }
  EXPECT_NE(error_of([&] { ckpt::HfWeights(dir.str() + "/absent"); }).find("no such"), std::string::npos);
  ckpt::make_directories(dir.str() + "/empty");
  EXPECT_NE(error_of([&] { ckpt::HfWeights(dir.str() + "/empty"); }).find("pytorch_model.bin"),
            std::string::npos);
}
