// Collectives as autograd functions: the exchanges whose gradient travels back the way the data
// came (the MoE layer's token dispatch, Ulysses' sequence and head exchange). Every member of the
// group calls each one in the same order, forward and backward.
#pragma once

#include <cstdint>
#include <vector>

#include <torch/torch.h>

#include "comm/process_group.h"

namespace strata::comm::autograd {

// Equal-split all_to_all_single along dim 0 over `group` (dim 0 divisible by its size),
// differentiable. Every member must call it, in the same order, forward and backward.
torch::Tensor all_to_all(const torch::Tensor& x, const comm::GroupPtr& group);

// Variable-split all_to_all_single along dim 0, differentiable: send[p] rows of x (in rank
// order) go to rank p, recv[p] rows come from rank p (x.size(0) = sum(send)); the result has
// sum(recv) rows. Backward sends the gradient back with the splits swapped. Zero splits are
// fine; every member calls it, in the same order, forward and backward.
torch::Tensor all_to_all_variable(const torch::Tensor& x, const comm::GroupPtr& group,
                                  const std::vector<int64_t>& send,
                                  const std::vector<int64_t>& recv);

}  // namespace strata::comm::autograd
