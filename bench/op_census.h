// strata-bench moe-ops: what a piece of code asks of the device, op by op, counted on any device
// (the CPU included), where bench/op_profile.h times it on a GPU. A RecordFunction callback sees
// every dispatched op and autograd node; the ops counted are the outermost ones, those the
// program, an autograd node or a custom function calls (about one kernel each on a GPU, whatever
// a CPU implementation dispatches inside). For each the census keeps its calls and the bytes of
// its tensor inputs and outputs (an in-place op's tensor is counted as read and as written): on
// a GPU a memory-bound op's time is about these bytes over the bandwidth, and each call is a
// launch. Matrix products and attention are counted apart, as "products": their time is their
// FLOPs'. An op that is only a view or an allocation (nothing inside it moves data) is left out.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace strata::bench {

struct OpCount {
  int64_t calls = 0;
  int64_t bytes = 0;  // inputs + outputs, over all calls
};

class OpCensus {
 public:
  OpCensus();  // starts counting
  ~OpCensus();
  void stop();
  void resume();  // counts again, adding to what it has
  // Leaves that move memory, by name; products (mm, bmm, grouped, attention) by name apart.
  const std::map<std::string, OpCount>& memory_ops() const;
  const std::map<std::string, OpCount>& products() const;
  OpCount memory_total() const;
  OpCount products_total() const;
  // The `top` memory-moving ops by bytes, then the products, per step (MB and calls).
  void print(int top, int steps) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace strata::bench
