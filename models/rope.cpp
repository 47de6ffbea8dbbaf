#include "models/rope.h"

#include <cmath>

namespace strata::models {

torch::Tensor rope_inverse_frequencies(const DecoderConfig& config) {
  const int64_t dim = config.head_dim;
  // theta ** (arange(0, dim, 2) / dim) in float32, as transformers computes it.
  const auto exponents = torch::arange(0, dim, 2, torch::kLong).to(torch::kFloat) / double(dim);
  auto inv = 1.0 / torch::pow(config.rope_theta, exponents);
  if (!config.rope_llama3) return inv;
  // _compute_llama3_parameters, step for step (float32 tensors, double scalars).
  const auto& s = config.llama3;
  const double original = double(s.original_max_position_embeddings);
  const double low_wavelen = original / s.low_freq_factor;
  const double high_wavelen = original / s.high_freq_factor;
  const auto wavelen = 2 * M_PI / inv;
  auto scaled = torch::where(wavelen > low_wavelen, inv / s.factor, inv);
  const auto smooth = (original / wavelen - s.low_freq_factor) /
                      (s.high_freq_factor - s.low_freq_factor);
  const auto smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled;
  const auto medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return torch::where(medium, smoothed, scaled);
}

std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const torch::Tensor& inverse_frequencies,
                                                     int64_t seq, torch::Device device,
                                                     torch::ScalarType dtype) {
  const auto positions = torch::arange(seq, torch::dtype(torch::kFloat).device(device));
  const auto freqs = torch::outer(positions, inverse_frequencies.to(device));  // [seq, dim/2]
  const auto angles = torch::cat({freqs, freqs}, -1);
  return {angles.cos().to(dtype), angles.sin().to(dtype)};
}

}  // namespace strata::models
