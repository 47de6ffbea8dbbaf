#include "runtime/model_check.h"

#include <algorithm>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

#include "moe/expert_params.h"
#include "runtime/error.h"

namespace strata {
namespace {

// FNV-1a: a digest that is the same in every process (std::hash need not be).
int64_t digest(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) h = (h ^ c) * 1099511628211ull;
  return static_cast<int64_t>(h >> 1);  // non-negative: 0 marks "no entry" below
}

std::vector<std::string> describe(torch::nn::Module& module, const NameFilter& include,
                                  bool buffers) {
  std::vector<std::string> out;
  for (const auto& p : module.named_parameters()) {
    if (include && !include(p.key())) continue;
    out.push_back(fmt::format("parameter '{}' {} {}{}", p.key(), c10::str(p.value().sizes()),
                              c10::toString(p.value().scalar_type()),
                              p.value().requires_grad() ? " requires_grad" : " frozen"));
  }
  if (!buffers) return out;
  for (const auto& b : module.named_buffers())
    out.push_back(fmt::format("buffer '{}' {} {}", b.key(), c10::str(b.value().sizes()),
                              c10::toString(b.value().scalar_type())));
  return out;
}

// Every rank's `text` (at most `width` bytes each), gathered as int64 words.
std::vector<std::string> gather_text(comm::ProcessGroup& group, const std::string& text) {
  constexpr int64_t width = 256;
  auto mine = torch::zeros({width}, torch::kLong);
  auto* w = mine.data_ptr<int64_t>();
  for (size_t i = 0; i < std::min<size_t>(text.size(), width); ++i)
    w[i] = static_cast<unsigned char>(text[i]);
  auto all = torch::zeros({group.size() * width}, torch::kLong);
  group.all_gather(all, mine);
  std::vector<std::string> out(group.size());
  const auto* a = all.data_ptr<int64_t>();
  for (int r = 0; r < group.size(); ++r)
    for (int64_t i = 0; i < width && a[r * width + i] != 0; ++i)
      out[r] += static_cast<char>(a[r * width + i]);
  return out;
}

}  // namespace

std::vector<NamedTensor> unique_parameters(torch::nn::Module& module, bool trainable_only) {
  std::vector<NamedTensor> out;
  std::unordered_map<const c10::TensorImpl*, size_t> seen;  // -> its place in `out`
  for (const auto& p : module.named_parameters()) {
    if (trainable_only && !p.value().requires_grad()) continue;
    const auto [it, first] = seen.emplace(p.value().unsafeGetTensorImpl(), out.size());
    if (first)
      out.push_back({p.key(), p.value(), {}});
    else
      out[it->second].aliases.push_back(p.key());
  }
  return out;
}

void cast_floating_point(torch::nn::Module& module, torch::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  auto cast = [dtype](torch::Tensor t) {
    if (t.defined() && t.is_floating_point() && t.scalar_type() != dtype) t.set_data(t.to(dtype));
  };
  for (auto& p : module.parameters()) cast(p);
  for (auto& b : module.named_buffers())
    if (!moe::is_float32_buffer_name(b.key())) cast(b.value());
}

void broadcast_buffers(torch::nn::Module& module, comm::ProcessGroup& group) {
  torch::NoGradGuard no_grad;
  std::map<torch::ScalarType, std::vector<torch::Tensor>> by_dtype;  // the same order on every rank
  for (auto& b : module.buffers())
    if (b.defined() && b.numel() > 0) by_dtype[b.scalar_type()].push_back(b);
  for (auto& [dtype, buffers] : by_dtype) {
    if (buffers.size() == 1 && buffers[0].is_contiguous()) {
      group.broadcast(buffers[0], 0);
      continue;
    }
    std::vector<torch::Tensor> flat;
    for (const auto& b : buffers) flat.push_back(b.reshape({-1}));
    auto all = torch::cat(flat);
    group.broadcast(all, 0);
    int64_t offset = 0;
    for (auto& b : buffers) {
      b.copy_(all.narrow(0, offset, b.numel()).view(b.sizes()));
      offset += b.numel();
    }
  }
}

void check_one_device(const std::vector<NamedTensor>& params) {
  for (const auto& p : params)
    if (p.tensor.device() != params.front().tensor.device())
      throw Error(fmt::format(
          "strata::initialize: the trainable parameters are on more than one device ('{}' on "
          "{}, '{}' on {}); Strata trains a model on one device per rank: move the whole model "
          "there (model->to(device)) before strata::initialize",
          params.front().name, params.front().tensor.device().str(), p.name,
          p.tensor.device().str()));
}

void check_same_model_on_every_rank(torch::nn::Module& module, comm::ProcessGroup& group,
                                    const NameFilter& include, bool buffers) {
  const auto entries = describe(module, include, buffers);
  const int world = group.size();
  // Round 1: the longest list. Round 2: every rank's digests, padded with 0.
  auto count = torch::tensor({static_cast<int64_t>(entries.size())}, torch::kLong);
  group.all_reduce(count, comm::ReduceOp::Max);
  const int64_t n = count.item<int64_t>() + 1;  // + the whole list's length
  auto mine = torch::zeros({n}, torch::kLong);
  mine[0] = static_cast<int64_t>(entries.size()) + 1;
  for (size_t i = 0; i < entries.size(); ++i) mine[i + 1] = digest(entries[i]);
  auto all = torch::zeros({world * n}, torch::kLong);
  group.all_gather(all, mine);
  const auto* d = all.data_ptr<int64_t>();
  // The first entry where some rank differs from rank 0 (the same answer on every rank).
  int64_t first = -1;
  int other = -1;
  for (int64_t i = 1; i < n && first < 0; ++i)
    for (int r = 1; r < world; ++r)
      if (d[r * n + i] != d[i]) {
        first = i - 1;
        other = r;
        break;
      }
  if (first < 0) return;
  const std::string text = first < static_cast<int64_t>(entries.size())
                               ? entries[first]
                               : fmt::format("nothing (only {} tensors)", entries.size());
  const auto texts = gather_text(group, text);
  throw Error(fmt::format(
      "strata::initialize: the ranks built different models: tensor #{} (parameters, then "
      "buffers, in module order) is {} on rank 0 but {} on rank {} (this is rank {}); every "
      "rank must construct the same model (same sizes, dtypes and frozen parameters) before "
      "strata::initialize",
      first, texts[0], texts[other], other, group.rank()));
}

}  // namespace strata
