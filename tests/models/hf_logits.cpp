// hf_logits FOLDER IDS OUT: Strata's logits for a Hugging Face folder, for scripts/hf_roundtrip.py
// to compare with transformers' own. FOLDER's config.json builds the model (models/causal_lm.h),
// its safetensors weights are imported (runtime/checkpoint/import_weights.h, strictly), IDS is a
// safetensors file holding "input_ids" [batch, seq] int64, OUT receives "logits" [batch, seq,
// vocab] float32. Exit 0 done, 1 error.
#include <cstdio>

#include <torch/torch.h>

#include "models/causal_lm.h"
#include "runtime/checkpoint/hf_folder.h"
#include "runtime/checkpoint/import_weights.h"
#include "runtime/checkpoint/safetensors.h"

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: hf_logits FOLDER IDS.safetensors OUT.safetensors\n");
    return 2;
  }
  try {
    namespace ckpt = strata::checkpoint;
    const auto config = strata::models::read_hf_config(argv[1]);
    strata::models::CausalLM model(config);
    const auto r = ckpt::import_weights(*model, ckpt::HfWeights(argv[1]),
                                        strata::models::hf_import_options(*model));
    torch::NoGradGuard no_grad;
    model->eval();
    const auto ids = ckpt::load_safetensors(argv[2]).at("input_ids");
    const auto logits = model->logits(ids).to(torch::kFloat);
    ckpt::save_safetensors(argv[3], {{"logits", logits}});
    std::printf("hf_logits: %lld tensors imported, logits %s\n", (long long)r.tensors,
                c10::str(logits.sizes()).c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "hf_logits: error: %s\n", e.what());
    return 1;
  }
}
