#include "runtime/checkpoint/consolidate.h"

#include <map>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "moe/expert_params.h"
#include "runtime/checkpoint/atomic_file.h"
#include "runtime/checkpoint/layout.h"
#include "runtime/checkpoint/saved_experts.h"
#include "runtime/checkpoint/saved_partitions.h"
#include "runtime/checkpoint/shard_pieces.h"
#include "runtime/error.h"

namespace strata::checkpoint {

namespace {

// JSON and LibTorch errors from what a checkpoint's scalars say (every file passed its checksum;
// a crafted or buggy checkpoint can still be inconsistent) become one naming the checkpoint.
template <class F>
auto naming(const std::string& folder, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw Error(fmt::format("checkpoint '{}' cannot be consolidated: {}", folder,
                            e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw Error(fmt::format("checkpoint '{}' cannot be consolidated: {}", folder, e.what()));
  }
}

bool cast_key(const std::string& key) {
  return key.rfind("param.", 0) == 0 || !moe::is_float32_buffer_name(key.substr(key.find('.') + 1));
}

}  // namespace

FullWeights::~FullWeights() = default;

const std::string& FullWeights::folder() const { return reader_->folder(); }
bool FullWeights::casts(const std::string& key) const { return cast_key(key); }
const json& FullWeights::model_scalars() const { return model_->scalars(); }

FullWeights::FullWeights(const std::string& dir, const std::string& tag)
    : reader_(std::make_unique<CheckpointReader>(dir, tag)) {
  naming(reader_->folder(), [&] {
    const auto& reader = *reader_;
    model_ = reader.open_shared("model_states");
    const bool partitioned = reader.has_partition("optim_states");
    // The optimizer files by range: only their masters are read, not the moments beside them.
    auto first = partitioned ? reader.open_partition("optim_states", 0)
                             : reader.open_shared("optim_states");
    if (first->scalars().value("layout", "") == "flat") {
      std::vector<std::unique_ptr<TensorFileReader>> files;
      files.push_back(std::move(first));
      const int parts = partitioned ? reader.world_size() : 1;
      for (int p = 1; p < parts; ++p) files.push_back(reader.open_partition("optim_states", p));
      master_ = std::make_unique<SavedPartitions>(std::move(files));
      const json& scalars = master_->scalars();
      const std::string& path = master_->file(0).path();
      const json& names = scalars.at("flat_params");
      if (!names.is_array()) throw Error(fmt::format("{}: flat_params is not a list", path));
      int64_t offset = 0;
      const int64_t flat = master_->flat_numel();
      for (const auto& name : names) {
        const auto numel = model_->numel("param." + name.get<std::string>());
        if (numel > flat - offset)
          throw Error(fmt::format("{}: parameter {} ends past the {} elements of the flat layout",
                                  path, name.dump(), flat));
        master_range_[name.get<std::string>()] = {offset, numel};
        offset += numel;
      }
      if (offset != flat)  // the flat layout is the parameters back to back, no gaps
        throw Error(fmt::format("{}: flat_params cover {} of the {} elements of the flat layout",
                                path, offset, flat));
      // Tied weights: a second name of one tensor takes the range of the name it was saved under.
      const json aliases = scalars.value("flat_param_aliases", json::object());
      for (const auto& [alias, name] : aliases.items())
        master_range_[alias] = master_range_.at(name.get<std::string>());
    }
    for (const auto& spec : model_->info().tensors) {
      auto s = spec;
      const auto name = s.name.substr(s.name.find('.') + 1);
      if (s.name.rfind("param.", 0) == 0 && master_range_.count(name)) s.dtype = torch::kFloat;
      specs_.push_back(std::move(s));
    }
    // MoE experts, saved per expert: whole, as the ep_size 1 model names them, from their fp32
    // master weights.
    if (reader.has_partition("expert_states")) {
      const SavedExperts experts(reader);
      for (auto& [name, t] : experts.parameters(experts.assemble("master"))) {
        specs_.push_back({"param." + name, t.scalar_type(), t.sizes().vec()});
        experts_.emplace("param." + name, t);
      }
    }
  });
}

torch::Tensor FullWeights::read(const std::string& key) const {
  const auto e = experts_.find(key);
  if (e != experts_.end()) return e->second;
  const auto name = key.substr(key.find('.') + 1);
  const auto range = master_range_.find(name);
  if (key.rfind("param.", 0) != 0 || range == master_range_.end()) return model_->at(key);
  auto out = torch::empty(model_->spec(key).shape, torch::kFloat);
  master_->read("master", zero::ShardMap::contiguous(master_->flat_numel(), 1), 0,
                range->second.first, range->second.second, out.data_ptr());
  return out;
}

torch::Tensor FullWeights::at(const std::string& key, torch::ScalarType dtype) const {
  return naming(folder(), [&] {
    auto t = read(key);
    return t.is_floating_point() && cast_key(key) ? t.to(dtype) : t;
  });
}

NamedTensors consolidate(const std::string& dir, const std::string& tag,
                         torch::ScalarType dtype) {
  const FullWeights weights(dir, tag);
  NamedTensors out;
  for (const auto& spec : weights.specs()) out.emplace_back(spec.name, weights.at(spec.name, dtype));
  return out;
}

namespace {

// A module of the archive tree: its own tensors and its children by name.
struct Node {
  NamedTensors parameters, buffers;
  std::map<std::string, std::unique_ptr<Node>> children;
  std::vector<std::string> order;  // children in first-seen order
};

// The node of module path `dotted` ("a.b"; "" is the root), created with its parents as needed.
Node& node_at(Node& root, const std::string& dotted) {
  Node* node = &root;
  if (dotted.empty()) return root;
  size_t start = 0;
  for (bool last = false; !last; ) {
    size_t dot = dotted.find('.', start);
    last = dot == std::string::npos;
    const auto part = dotted.substr(start, last ? std::string::npos : dot - start);
    auto& child = node->children[part];
    if (!child) {
      child = std::make_unique<Node>();
      node->order.push_back(part);
    }
    node = child.get();
    start = dot + 1;
  }
  return *node;
}

void insert(Node& root, const std::string& dotted, const torch::Tensor& t, bool buffer) {
  const size_t dot = dotted.rfind('.');
  Node& node = node_at(root, dot == std::string::npos ? "" : dotted.substr(0, dot));
  (buffer ? node.buffers : node.parameters)
      .emplace_back(dot == std::string::npos ? dotted : dotted.substr(dot + 1), t);
}

// A tensor that owns its bytes: a view into a larger buffer (a flat partition's parameter, a
// slice of the consolidated master) is copied, since LibTorch 2.x's torch::load sets each
// parameter to the saved storage and refuses a view's offset past the bytes it wrote.
torch::Tensor owned(const torch::Tensor& t) {
  const bool whole = t.is_contiguous() && t.storage_offset() == 0 &&
                     t.storage().nbytes() == size_t(t.numel()) * t.element_size();
  return whole ? t : t.clone(at::MemoryFormat::Contiguous);
}

void write(const Node& node, torch::serialize::OutputArchive& archive) {
  for (const auto& [name, t] : node.parameters) archive.write(name, owned(t));
  for (const auto& [name, t] : node.buffers) archive.write(name, owned(t), /*is_buffer=*/true);
  for (const auto& name : node.order) {
    torch::serialize::OutputArchive child(archive.compilation_unit());
    write(*node.children.at(name), child);
    archive.write(name, child);
  }
}

}  // namespace

void save_module_archive(const std::string& path, const NamedTensors& parameters,
                         const NamedTensors& buffers, const std::vector<std::string>& submodules) {
  Node root;
  for (const auto& m : submodules) node_at(root, m);  // first: the children in module order
  for (const auto& [name, t] : parameters) insert(root, name, t, false);
  for (const auto& [name, t] : buffers) insert(root, name, t, true);
  torch::serialize::OutputArchive archive;
  write(root, archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  write_file_atomic(path, bytes.str());
}

std::optional<std::vector<std::string>> saved_submodules(const std::string& dir,
                                                         const std::string& tag) {
  CheckpointReader reader(dir, tag, {/*verify_checksums=*/false});
  const auto* entry = reader.manifest().find("model_states", -1);
  if (!entry) return std::nullopt;
  const auto info = read_tensor_file_info(reader.path_of(*entry));
  if (!info.scalars.contains(kSubmodulesKey)) return std::nullopt;
  const json& list = info.scalars.at(kSubmodulesKey);
  std::vector<std::string> out;
  if (list.is_array())
    for (const auto& m : list) {
      if (!m.is_string()) break;
      const auto path = m.get<std::string>();
      if (path.empty() || path.front() == '.' || path.back() == '.' ||
          path.find("..") != std::string::npos)
        break;  // one malformed path: refused below
      out.push_back(path);
    }
  if (!list.is_array() || out.size() != list.size())
    throw Error(fmt::format("{}: '{}' is not a list of module paths", info.path, kSubmodulesKey));
  return out;
}

}  // namespace strata::checkpoint
