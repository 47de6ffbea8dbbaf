// The boundary between the C++ side of runtime/nn's fused layers (tensors, autograd, streams) and
// their CUDA kernels (nvcc, no LibTorch headers): raw pointers, element types, the stream. Each
// launch returns null, or CUDA's error text. The C++ side checks shapes, dtypes and layouts first;
// what it cannot express here (a strided view, an unsupported dtype pair) runs the composite ops.
#pragma once

#include <cstdint>

namespace strata::nn::cuda {

enum class FloatType : int { kFloat32, kBFloat16, kFloat16 };

// RMSNorm over rows of `cols` contiguous elements: x of x_type; weight of weight_type (x_type or
// fp32); out of x_type, or fp32 when the weight is (torch's promotion of weight * normed).
struct RmsNormForward {
  const void* x = nullptr;
  const void* weight = nullptr;
  void* out = nullptr;
  float* rstd = nullptr;  // [rows]: 1 / sqrt(mean(x^2) + eps), kept for backward
  FloatType x_type = FloatType::kFloat32;
  FloatType weight_type = FloatType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  float eps = 0;
  void* stream = nullptr;  // cudaStream_t
  int multiprocessors = 0;
};

struct RmsNormBackward {
  const void* grad_out = nullptr;  // the output's type
  const void* x = nullptr;
  const void* weight = nullptr;
  const float* rstd = nullptr;
  void* grad_x = nullptr;               // x_type; null: not wanted
  float* grad_weight_partial = nullptr;  // [blocks, cols] fp32 sums over each block's rows; null: not wanted
  int blocks = 0;                        // rms_norm_backward_blocks()
  FloatType x_type = FloatType::kFloat32;
  FloatType weight_type = FloatType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  void* stream = nullptr;
};

// The widest row the kernels take (the backward's shared-memory sums of the weight's gradient).
constexpr int64_t kRmsNormMaxCols = 12288;
int rms_norm_backward_blocks(int64_t rows, int64_t cols, FloatType x_type, int multiprocessors);
const char* launch_rms_norm_forward(const RmsNormForward& launch);
const char* launch_rms_norm_backward(const RmsNormBackward& launch);

// Rotary position embedding (the rotate-half form of Llama/Qwen) of x [B, H, S, D], any strides
// with the last dimension contiguous, into out of the same shape (its own strides), by cos and sin
// [S, D] (row stride given, last dimension contiguous), all of one type. backward: the gradient of
// the same map (x is the output's gradient, out the input's).
struct Rotary {
  const void* x = nullptr;
  void* out = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  FloatType type = FloatType::kFloat32;
  int64_t sizes[4] = {0, 0, 0, 0};
  int64_t x_strides[3] = {0, 0, 0};    // B, H, S (D's is 1)
  int64_t out_strides[3] = {0, 0, 0};
  int64_t cos_stride = 0;  // between positions, of cos and of sin
  int64_t sin_stride = 0;
  bool backward = false;
  void* stream = nullptr;
};
const char* launch_rotary(const Rotary& launch);

// SwiGLU, silu(gate) * up, over `rows` rows of `cols` elements of one type: gate's and up's rows
// `in_stride` elements apart (gate and up two tensors, or the halves of one [rows, 2 * cols]); out
// contiguous; backward writes both inputs' gradients (rows `grad_stride` apart) from the output's,
// recomputing silu(gate).
struct SwiGlu {
  const void* gate = nullptr;
  const void* up = nullptr;
  void* out = nullptr;            // forward
  const void* grad_out = nullptr;  // backward
  void* grad_gate = nullptr;
  void* grad_up = nullptr;
  FloatType type = FloatType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t in_stride = 0;
  int64_t grad_stride = 0;
  void* stream = nullptr;
  int multiprocessors = 0;
};
const char* launch_swiglu_forward(const SwiGlu& launch);
const char* launch_swiglu_backward(const SwiGlu& launch);

}  // namespace strata::nn::cuda

namespace strata::nn::cuda {

// Softmax cross-entropy over rows of `vocab` contiguous logits (fp32/bf16/fp16), in place: each
// row's loss, log(sum(exp(l))) - l[target], into row_loss (0 for a target equal to ignore_index,
// NaN for one outside [0, vocab)); with write_grad, the row becomes the loss's gradient
// softmax(l) - one_hot(target) in the logits' type (zeros for an ignored row).
struct SoftmaxCrossEntropy {
  void* logits = nullptr;
  const int64_t* targets = nullptr;
  float* row_loss = nullptr;
  FloatType type = FloatType::kFloat32;
  int64_t rows = 0;
  int64_t vocab = 0;
  int64_t ignore_index = -100;
  bool write_grad = false;
  void* stream = nullptr;
  int multiprocessors = 0;
};
const char* launch_softmax_cross_entropy(const SoftmaxCrossEntropy& launch);

}  // namespace strata::nn::cuda
