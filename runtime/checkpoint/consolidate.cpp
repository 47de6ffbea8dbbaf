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

NamedTensors consolidate_checked(const CheckpointReader& reader, torch::ScalarType dtype) {
  const auto model = reader.load_shared("model_states");
  NamedTensors out;
  const bool partitioned = reader.has_partition("optim_states");
  // The optimizer files by range: only their masters are read, not the moments beside them.
  auto first = partitioned ? reader.open_partition("optim_states", 0)
                           : reader.open_shared("optim_states");
  std::map<std::string, torch::Tensor> master;  // parameter name -> fp32 full value
  if (first->scalars().value("layout", "") == "flat") {
    std::vector<std::unique_ptr<TensorFileReader>> files;
    files.push_back(std::move(first));
    const int parts = partitioned ? reader.world_size() : 1;
    for (int p = 1; p < parts; ++p) files.push_back(reader.open_partition("optim_states", p));
    const SavedPartitions saved(std::move(files));
    const json& scalars = saved.scalars();
    const std::string& path = saved.file(0).path();
    auto flat = torch::empty({saved.flat_numel()}, torch::kFloat);
    saved.read("master", zero::ShardMap::contiguous(flat.numel(), 1), 0, 0, flat.numel(),
               flat.data_ptr());
    int64_t offset = 0;
    const json& names = scalars.at("flat_params");
    if (!names.is_array()) throw Error(fmt::format("{}: flat_params is not a list", path));
    for (const auto& name : names) {
      const auto& param = model.at("param." + name.get<std::string>());
      if (param.numel() > flat.numel() - offset)
        throw Error(fmt::format("{}: parameter {} ends past the {} elements of the flat layout",
                                path, name.dump(), flat.numel()));
      master[name] = flat.narrow(0, offset, param.numel()).view(param.sizes());
      offset += param.numel();
    }
    if (offset != flat.numel())  // the flat layout is the parameters back to back, no gaps
      throw Error(fmt::format("{}: flat_params cover {} of the {} elements of the flat layout",
                              path, offset, flat.numel()));
    // Tied weights: a second name of one tensor takes the value of the name it was saved under.
    // (Named: items() of a temporary would dangle inside the loop.)
    const json aliases = scalars.value("flat_param_aliases", json::object());
    for (const auto& [alias, name] : aliases.items()) master[alias] = master.at(name.get<std::string>());
  }
  // Parameters from the fp32 master when there is one; frozen ones and buffers as saved. A
  // buffer that stays float32 (the MoE router's balancing bias) is not cast.
  for (const auto& [key, tensor] : model.tensors) {
    const bool param = key.rfind("param.", 0) == 0;
    const std::string name = key.substr(key.find('.') + 1);
    const auto it = master.find(name);
    const auto& value = param && it != master.end() ? it->second : tensor;
    const bool cast = value.is_floating_point() && (param || !moe::is_float32_buffer_name(name));
    out.emplace_back(key, cast ? value.to(dtype) : value);
  }
  // MoE experts, saved per expert: whole, as the ep_size 1 model names them, from their fp32
  // master weights.
  if (reader.has_partition("expert_states")) {
    const SavedExperts experts(reader);
    for (auto& [name, t] : experts.parameters(experts.assemble("master")))
      out.emplace_back("param." + name, t.to(dtype));
  }
  return out;
}

}  // namespace

NamedTensors consolidate(const std::string& dir, const std::string& tag,
                         torch::ScalarType dtype) {
  CheckpointReader reader(dir, tag);
  // Every file passed its checksum; what its scalars say can still be inconsistent (a crafted
  // or buggy checkpoint): JSON and LibTorch errors become one naming the checkpoint.
  try {
    return consolidate_checked(reader, dtype);
  } catch (const Error&) {
    throw;
  } catch (const c10::Error& e) {
    throw Error(fmt::format("checkpoint '{}' cannot be consolidated: {}", reader.folder(),
                            e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw Error(fmt::format("checkpoint '{}' cannot be consolidated: {}", reader.folder(),
                            e.what()));
  }
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
