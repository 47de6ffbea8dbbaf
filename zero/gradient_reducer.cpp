#include "zero/gradient_reducer.h"

#include <algorithm>
#include <unordered_set>

#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "runtime/error.h"
#include "zero/host_copy.h"

namespace strata::zero {
namespace {

// Runs after AccumulateGrad has written a parameter's .grad. Holds the reducer weakly: a hook
// outliving its engine does nothing.
class AfterAccumulation : public torch::autograd::FunctionPostHook {
 public:
  AfterAccumulation(std::weak_ptr<GradientReducer> reducer,
                    std::function<void(GradientReducer&)> fn)
      : reducer_(std::move(reducer)), fn_(std::move(fn)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list&) override {
    if (auto reducer = reducer_.lock()) fn_(*reducer);
    return outputs;
  }

 private:
  std::weak_ptr<GradientReducer> reducer_;
  std::function<void(GradientReducer&)> fn_;
};

}  // namespace

std::shared_ptr<GradientReducer> GradientReducer::create(std::vector<torch::Tensor> params,
                                                         comm::GroupPtr group, Options options) {
  std::shared_ptr<GradientReducer> reducer(
      new GradientReducer(std::move(params), std::move(group), std::move(options)));
  reducer->attach_hooks();
  return reducer;
}

std::vector<std::vector<size_t>> GradientReducer::plan(const std::vector<torch::Tensor>& params,
                                                       int64_t bucket_numel) {
  std::vector<std::vector<size_t>> buckets;
  int64_t fill = 0;
  for (size_t k = params.size(); k-- > 0;) {
    const auto& p = params[k];
    const bool fits = !buckets.empty() && bucket_numel > 0 && fill + p.numel() <= bucket_numel &&
                      params[buckets.back().front()].device() == p.device();
    if (!fits) {
      buckets.emplace_back();
      fill = 0;
    }
    buckets.back().push_back(k);
    fill += p.numel();
  }
  return buckets;
}

GradientReducer::GradientReducer(std::vector<torch::Tensor> params, comm::GroupPtr group,
                                 Options options)
    : params_(std::move(params)), group_(std::move(group)), options_(std::move(options)) {
  if (group_ && group_->size() == 1) group_.reset();
  const bool partition = options_.mode == Mode::kPartition;
  auto plan = options_.plan.empty() ? GradientReducer::plan(params_, options_.bucket_numel)
                                    : options_.plan;
  if (partition) {
    const int64_t parts = group_ ? group_->size() : 1;
    if (options_.flat_offsets.size() != params_.size() ||
        options_.shards.buckets().size() != plan.size() || options_.shards.parts() != parts ||
        (options_.send_chunk ? !options_.copy_to_partition
                             : options_.partition_grad.numel() != options_.shards.partition_numel()) ||
        (!options_.copy_to_partition && options_.partition_grad.device() != params_.front().device()))
      throw Error("GradientReducer: partition mode needs the bucket plan, every parameter's flat "
                  "offset and a bucketed ShardMap of those buckets for this group");
  }
  const bool local = !partition && !group_ && options_.local_flat.defined();
  if (local && (options_.flat_offsets.size() != params_.size()))
    throw Error("GradientReducer: local_flat needs every parameter's flat offset");
  if (local) accumulates_in_place_ = true;
  if (partition && !group_ && !options_.copy_to_partition) {
    accumulates_in_place_ = true;
    for (const auto& p : params_)
      accumulates_in_place_ = accumulates_in_place_ && (options_.comm_dtype == p.scalar_type() ||
                                                        options_.comm_dtype == torch::kFloat);
  }
  if (!options_.staged_when_complete.empty() && options_.staged_when_complete.size() != plan.size())
    throw Error("GradientReducer: staged_when_complete needs one entry per bucket of the plan");
  where_.resize(params_.size());
  arrived_.assign(params_.size(), false);
  expected_arrivals_ = params_.size();
  fresh_.assign(params_.size(), true);
  for (size_t b = 0; b < plan.size(); ++b) {
    auto& bucket = buckets_.emplace_back();
    const auto& first = params_.at(plan[b].front());
    int64_t fill = 0;
    for (size_t k : plan[b]) {
      where_.at(k) = {b, bucket.params.size()};
      bucket.params.push_back(k);
      if (partition) {
        // Flat order inside the bucket: the reduce-scatter's chunk r is rank r's piece.
        bucket.slots.push_back(options_.flat_offsets[k] - options_.shards.buckets()[b].lo);
      } else {
        bucket.slots.push_back(local ? options_.flat_offsets[k] : fill);
        fill += params_[k].numel();
      }
    }
    bucket.options = first.options().dtype(options_.comm_dtype);
    bucket.expected = bucket.params.size();
    bucket.staged_when_complete =
        !options_.staged_when_complete.empty() && options_.staged_when_complete[b];
    if (partition) {
      const auto& shard = options_.shards.buckets()[b];
      const int64_t parts = options_.shards.parts();
      bucket.numel = parts * shard.chunk;
      bucket.filled = shard.hi - shard.lo;  // the rest is padding, zeroed
      bucket.out_numel = shard.chunk;
      // In place: rank r's chunk of the bucket receives its reduction (NCCL's in-place form).
      bucket.out_offset = group_ ? group_->rank() * shard.chunk : 0;
      bucket.partition_offset = shard.base;
      bucket.on_device = options_.copy_to_partition && shard.base >= options_.device_lo &&
                         shard.base + shard.chunk <= options_.device_hi;
      if (bucket.on_device)
        bucket.accumulator = options_.device_partition_grad.narrow(0, shard.base - options_.device_lo,
                                                                   shard.chunk);
      else if (!options_.send_chunk)
        bucket.accumulator = options_.partition_grad.narrow(0, shard.base, shard.chunk);
    } else {
      bucket.numel = bucket.filled = bucket.out_numel = fill;
      if (local) bucket.accumulator = options_.local_flat;
    }
  }
  // Until the first backward teaches the order: the plan's, the buckets staged when complete
  // (spread over the model) last.
  for (const bool late : {false, true})
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (buckets_[b].staged_when_complete == late) launch_order_.push_back(b);
}

void GradientReducer::attach_hooks() {
  std::weak_ptr<GradientReducer> self = shared_from_this();
  for (size_t k = 0; k < params_.size(); ++k) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[k]);
    if (!accumulator)
      throw Error(fmt::format("parameter {} has no gradient accumulator (is it a leaf that "
                              "requires grad?)", k));
    accumulator->add_post_hook(std::make_unique<AfterAccumulation>(
        self, [k](GradientReducer& reducer) { reducer.on_gradient(k); }));
    accumulators_.push_back(std::move(accumulator));
  }
}

void GradientReducer::begin_backward(bool boundary, const torch::Tensor& loss) {
  // In place, every micro-step's gradients go to their places (and .grad is released).
  active_ = options_.mode == Mode::kPartition || accumulates_in_place_ || boundary;
  if (!active_) return;
  launched_during_backward_ = 0;
  // One process delivers each bucket as it completes (no order to keep), and finish() the rest.
  if (!options_.settle_unreached || !group_ || !loss.defined() || !loss.requires_grad()) return;
  find_unreached(loss);
  launch_ready_buckets();  // buckets backward never reaches at the head of the order go now
}

void GradientReducer::find_unreached(const torch::Tensor& loss) {
  using torch::autograd::Node;
  std::unordered_set<const Node*> seen;
  std::vector<Node*> stack;
  const auto root = loss.grad_fn() ? loss.grad_fn() : torch::autograd::impl::grad_accumulator(loss);
  if (!root) return;
  seen.insert(root.get());
  stack.push_back(root.get());
  while (!stack.empty()) {
    Node* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges())
      if (edge.function && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
  }
  expected_arrivals_ = 0;
  for (auto& bucket : buckets_) bucket.expected = 0;
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!seen.count(accumulators_[k].get())) continue;  // unreached: complete() stages it
    ++expected_arrivals_;
    ++buckets_[where_[k].first].expected;
  }
}

void GradientReducer::make_room(int64_t numel) {
  if (options_.max_live_numel <= 0) return;
  while (live_numel_ + numel > options_.max_live_numel && next_deliver_ < next_launch_)
    deliver(buckets_[launch_order_[next_deliver_++]]);
}

void GradientReducer::stage(size_t k) {
  const auto [b, i] = where_[k];
  auto& bucket = buckets_[b];
  if (accumulates_in_place_) {
    // One process: nothing to reduce, so the gradient goes straight into its place in the
    // partition's accumulator (the bucket's layout is the accumulator's), without a bucket.
    const auto& grad = params_[k].grad();
    auto place = bucket.accumulator.narrow(0, bucket.slots[i], params_[k].numel());
    const bool fresh = fresh_[k];
    fresh_[k] = false;
    if (grad.defined()) {
      const auto g = grad.is_sparse() ? grad.to_dense().reshape({-1}) : grad.reshape({-1});
      fresh ? place.copy_(g) : place.add_(g);
    } else if (fresh) {
      place.zero_();
    }
    params_[k].mutable_grad() = torch::Tensor();
    ++bucket.ready;
    return;
  }
  if (!bucket.flat.defined()) {
    // Allocated when its first gradient arrives and freed once delivered: only the buckets in
    // flight hold memory, not a second full-size gradient.
    make_room(bucket.numel);
    bucket.flat = torch::empty({bucket.numel}, bucket.options);
    live_numel_ += bucket.numel;
    peak_numel_ = std::max(peak_numel_, live_numel_);
    if (bucket.filled < bucket.numel)
      bucket.flat.narrow(0, bucket.filled, bucket.numel - bucket.filled).zero_();
  }
  auto slot = bucket.flat.narrow(0, bucket.slots[i], params_[k].numel());
  const auto& grad = params_[k].grad();
  if (grad.defined() && grad.is_sparse())  // Embedding(...).sparse(true): sent dense
    slot.copy_(grad.to_dense().reshape({-1}));
  else if (grad.defined())
    slot.copy_(grad.reshape({-1}));
  else
    slot.zero_();
  if (options_.mode == Mode::kPartition) params_[k].mutable_grad() = torch::Tensor();
  ++bucket.ready;
}

void GradientReducer::on_gradient(size_t k) {
  if (!active_) return;  // accumulating locally inside the window
  if (arrived_[k])
    throw Error(fmt::format(
        "parameter {} received a second gradient in one reducing backward; call "
        "engine->backward() once per micro-step",
        k));
  arrive(k);
}

void GradientReducer::arrive(size_t k) {
  arrived_[k] = true;
  ++arrivals_;
  const size_t b = where_[k].first;
  auto& bucket = buckets_[b];
  ++bucket.arrived;
  if (!bucket.staged_when_complete) stage(k);
  if (bucket.arrived < bucket.expected) return;  // more of its gradients are to come
  complete(b);
  launch_ready_buckets();
}

void GradientReducer::complete(size_t b) {
  auto& bucket = buckets_[b];
  for (size_t p : bucket.params) {
    // Staged already: what arrived in a bucket that stages on arrival (arrive()).
    const bool staged = arrived_[p] && !bucket.staged_when_complete;
    if (!arrived_[p]) {  // unreached: no gradient comes, it contributes what .grad holds
      arrived_[p] = true;
      ++bucket.arrived;
    }
    if (!staged) stage(p);  // staged_when_complete: all at once, the buffer lives from here
  }
  completed_.push_back(b);
  // One process: no collective whose order the ranks must agree on, so each bucket is delivered
  // (and freed) as soon as it is complete.
  if (!group_) deliver(bucket);
}

void GradientReducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size()) {
    auto& bucket = buckets_[launch_order_[next_launch_]];
    // A bucket backward does not reach at all is staged when its turn comes (its buffer then
    // lives no longer than a reached bucket's).
    if (bucket.ready != bucket.params.size() && bucket.expected == 0 && bucket.arrived == 0)
      complete(launch_order_[next_launch_]);
    if (bucket.ready != bucket.params.size()) break;
    ++next_launch_;
    if (group_) {
      if (options_.mode == Mode::kPartition)
        bucket.work = group_->reduce_scatter_async(
            bucket.flat.narrow(0, bucket.out_offset, bucket.out_numel), bucket.flat,
            comm::ReduceOp::Avg);
      else
        bucket.work = group_->all_reduce_async(bucket.flat, comm::ReduceOp::Avg);
      if (arrivals_ < expected_arrivals_) ++launched_during_backward_;
    }
  }
  // Deliver (and free) all but the last kInFlight launched buckets: their collectives have had
  // a bucket's worth of backward to finish, so waiting on them rarely holds the compute stream.
  while (next_deliver_ + kInFlight < next_launch_)
    deliver(buckets_[launch_order_[next_deliver_++]]);
}

// The first backward over a group: rank 0's completion order becomes every rank's launch order
// (a broadcast, once). Every bucket completes once per reducing backward, so it is a permutation.
void GradientReducer::learn_launch_order() {
  order_learnt_ = true;
  if (!group_ || completed_.size() != buckets_.size()) return;
  std::vector<int64_t> order;
  for (size_t b : completed_)
    if (buckets_[b].expected > 0) order.push_back(int64_t(b));
  // A bucket this backward did not reach completed at its turn, not when backward was done with
  // it: it goes after the bucket its old order put before it (or first), where a backward that
  // reaches it will most likely complete it.
  for (size_t i = 0; i < launch_order_.size(); ++i) {
    const size_t b = launch_order_[i];
    if (buckets_[b].expected > 0) continue;
    auto at = order.begin();
    if (i > 0) {
      const auto before = std::find(order.begin(), order.end(), int64_t(launch_order_[i - 1]));
      if (before != order.end()) at = before + 1;
    }
    order.insert(at, int64_t(b));
  }
  auto t = torch::tensor(order, torch::kLong).to(buckets_.front().options.device());
  group_->broadcast(t, 0);
  t = t.cpu();
  const auto* o = t.data_ptr<int64_t>();
  std::vector<bool> seen(buckets_.size(), false);
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const auto b = o[i];
    if (b < 0 || size_t(b) >= buckets_.size() || seen[size_t(b)])
      throw Error("GradientReducer: rank 0's bucket order is not a permutation of the buckets");
    seen[size_t(b)] = true;
    launch_order_[i] = size_t(b);
  }
}

void GradientReducer::deliver(Bucket& bucket) {
  if (accumulates_in_place_) return;  // stage() did it
  if (!bucket.flat.defined()) return;  // delivered already (one process, out of order)
  if (bucket.work) bucket.work->wait();
  const auto out = bucket.flat.narrow(0, bucket.out_offset, bucket.out_numel);
  if (options_.mode == Mode::kPartition && options_.copy_to_partition && bucket.on_device) {
    // The share of the partition whose optimizer stays on the device: summed there.
    if (options_.sum_squares.defined())
      options_.sum_squares.add_(
          at::linalg_vector_norm(out, 2, c10::nullopt, false, torch::kFloat).to(torch::kDouble).pow(2));
    bucket.fresh ? bucket.accumulator.copy_(out) : bucket.accumulator.add_(out);
    bucket.fresh = false;
  } else if (options_.mode == Mode::kPartition && options_.copy_to_partition) {
    // The reduced chunk's sum of squares stays on the device (a window of one micro-step: it is
    // the gradient norm's share, with no pass over the host copy).
    if (options_.sum_squares.defined())
      options_.sum_squares.add_(
          at::linalg_vector_norm(out, 2, c10::nullopt, false, torch::kFloat).to(torch::kDouble).pow(2));
    if (options_.send_chunk)
      options_.send_chunk(bucket.partition_offset, out);
    else if (options_.on_copied)
      options_.on_copied(bucket.partition_offset, bucket.out_numel,
                         copy_to_host_tracked(bucket.accumulator, out));
    else
      copy_to_host_async(bucket.accumulator, out);
  } else if (options_.mode == Mode::kPartition) {
    bucket.fresh ? bucket.accumulator.copy_(out) : bucket.accumulator.add_(out);
    bucket.fresh = false;
  } else {
    for (size_t i = 0; i < bucket.params.size(); ++i) {
      auto& p = params_[bucket.params[i]];
      auto reduced = bucket.flat.narrow(0, bucket.slots[i], p.numel());
      if (p.grad().defined() && !p.grad().is_sparse())
        p.mutable_grad().copy_(reduced.view_as(p));
      else
        p.mutable_grad() = reduced.view_as(p).to(p.scalar_type()).clone();
    }
  }
  bucket.work.reset();
  bucket.flat = torch::Tensor();  // stream-safe: the collective's stream use was recorded
  live_numel_ -= bucket.numel;
}

void GradientReducer::begin_window() {
  std::fill(fresh_.begin(), fresh_.end(), true);
  for (auto& bucket : buckets_) bucket.fresh = true;
}

void GradientReducer::settle_window() {
  if ((options_.mode != Mode::kPartition && !accumulates_in_place_) || options_.copy_to_partition)
    return;
  for (auto& bucket : buckets_) {
    if (accumulates_in_place_) {
      for (size_t i = 0; i < bucket.params.size(); ++i)
        if (fresh_[bucket.params[i]]) {
          bucket.accumulator.narrow(0, bucket.slots[i], params_[bucket.params[i]].numel()).zero_();
          fresh_[bucket.params[i]] = false;
        }
    } else if (bucket.fresh) {
      bucket.accumulator.zero_();
      bucket.fresh = false;
    }
  }
}

void GradientReducer::finish() {
  if (!active_) return;
  active_ = false;
  for (size_t k = 0; k < params_.size(); ++k)
    if (!arrived_[k]) arrive(k);  // no gradient this backward: contributes what .grad holds
  launch_ready_buckets();
  while (next_deliver_ < next_launch_) deliver(buckets_[launch_order_[next_deliver_++]]);
  if (!order_learnt_ && group_) learn_launch_order();
  for (auto& bucket : buckets_) {
    bucket.ready = bucket.arrived = 0;
    bucket.expected = bucket.params.size();
  }
  std::fill(arrived_.begin(), arrived_.end(), false);
  expected_arrivals_ = params_.size();
  completed_.clear();
  arrivals_ = 0;
  next_launch_ = next_deliver_ = 0;
}

}  // namespace strata::zero
