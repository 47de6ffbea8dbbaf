// The README's ten lines around a plain LibTorch model: fits y = x·w with a small MLP for 20
// steps and exits 0 when the loss fell (mean of the last five steps below half the first five).
// Then a one-layer Llama from a config.json text through <strata/models.h> (the installed
// models library links and runs): one forward's loss is finite.
//   consumer CONFIG.json
#include <strata/models.h>
#include <strata/strata.h>
#include <torch/torch.h>

#include <cmath>

#include <cstdio>

struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(8, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 1))) {}
  torch::Tensor forward(torch::Tensor x, torch::Tensor y) {
    return torch::mse_loss(fc2(torch::tanh(fc1(x))), y);
  }
  torch::nn::Linear fc1, fc2;
};
TORCH_MODULE(Net);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: consumer CONFIG.json\n");
    return 2;
  }
  try {
    std::printf("%s\n", strata::version_line());
    torch::manual_seed(0);
    const auto w = torch::randn({8, 1});
    Net model;
    auto engine = strata::initialize(model, argv[1]);
    double first = 0, last = 0;
    const int64_t steps = 20;
    for (int64_t step = 0; step < steps; ++step) {
      auto x = torch::randn({engine->train_micro_batch_size_per_gpu(), 8});
      auto y = x.matmul(w);
      auto loss = engine->forward(x, y);
      engine->backward(loss);
      engine->step();
      const double l = loss.item<double>();
      if (step < 5) first += l / 5;
      if (step >= steps - 5) last += l / 5;
      std::printf("step %2lld loss %.4f\n", static_cast<long long>(step + 1), l);
    }
    std::printf("loss %.4f -> %.4f over %lld steps\n", first, last, static_cast<long long>(steps));
    const auto llama = strata::models::parse_hf_config(
        nlohmann::json::parse(R"({"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
                                  "intermediate_size": 32, "num_hidden_layers": 1,
                                  "num_attention_heads": 2, "num_key_value_heads": 1})"),
        "consumer's llama");
    strata::models::CausalLM lm(llama);
    const auto ids = torch::randint(0, 32, {2, 8});
    const double lm_loss = lm->forward(ids, ids).item<double>();
    std::printf("llama: loss %.4f\n", lm_loss);
    if (!std::isfinite(lm_loss)) return 1;
    return last < 0.5 * first ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "consumer: error: %s\n", e.what());
    return 1;
  }
}
