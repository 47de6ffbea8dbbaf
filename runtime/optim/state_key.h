// The key under which torch::optim::Optimizer keeps a parameter's state. LibTorch 1.13 keys
// `state_` by the TensorImpl pointer printed as a string (c10::guts::to_string, i.e. ostream <<
// pointer), LibTorch 2.x by the pointer itself. Deducing it from the map's key type keeps both
// working without a version check, and stays in step with torch::optim::serialize(), which
// re-keys loaded state the same way.
#pragma once

#include <torch/torch.h>

#include <sstream>
#include <string>
#include <type_traits>

namespace strata::optim::detail {

template <class StateMap>
typename StateMap::key_type state_key(const torch::Tensor& param) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream out;
    out << static_cast<const void*>(param.unsafeGetTensorImpl());
    return out.str();
  } else {
    return static_cast<Key>(param.unsafeGetTensorImpl());
  }
}

}  // namespace strata::optim::detail
