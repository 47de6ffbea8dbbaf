// A loaded checkpoint's names, shapes and dtypes must be the model's: a model with a renamed,
// reshaped, retyped, missing or extra tensor (parameter or buffer) is refused by name, at ZeRO
// stages 0 to 3, before anything is copied (the model keeps its own weights and the engine its
// step count).
#include <functional>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "runtime/checkpoint/atomic_file.h"
#include "runtime/error.h"
#include "tests/runtime/checkpoint/engine_model.h"
#include "tests/runtime/checkpoint/scratch_dir.h"

namespace {

using strata::test::TinyNet;
using strata::test::TinyNetImpl;

struct Case {
  std::string what;
  std::function<std::shared_ptr<TinyNetImpl>()> make;
  bool bf16;
  std::vector<std::string> expect;  // each must appear in the error
};

}  // namespace

TEST(ModelMatch, OtherNamesShapesAndDtypesAreRefusedByName) {
  const std::vector<Case> cases = {
      {"a renamed module", [] { return std::make_shared<TinyNetImpl>(3, "head"); }, false,
       {"model_states.ckpt", "'param.head.weight' is missing"}},
      {"a wider layer", [] { return std::make_shared<TinyNetImpl>(5); }, false,
       {"model_states.ckpt", "'param.fc.weight' has shape [3, 4] in the file but [5, 4]"}},
      {"bf16 parameters", [] { return std::make_shared<TinyNetImpl>(3); }, true,
       {"model_states.ckpt", "'param.fc.weight' is F32 in the file but BF16 is expected"}},
      {"a longer buffer", [] { return std::make_shared<TinyNetImpl>(3, "fc", 2); }, false,
       {"model_states.ckpt", "'buffer.calls' has shape [1] in the file but [2]"}},
      {"no bias", [] { return std::make_shared<TinyNetImpl>(3, "fc", 1, false); }, false,
       {"model_states.ckpt", "holds tensor 'param.fc.bias', which is not expected"}},
      {"one more parameter",
       [] { return std::make_shared<TinyNetImpl>(3, "fc", 1, true, true); }, false,
       {"model_states.ckpt", "'param.scale' is missing"}},
  };
  for (int stage : {0, 1, 2, 3}) {
    strata::test::ScratchDir tmp;
    {
      torch::manual_seed(1);
      TinyNet saved;
      auto engine = strata::initialize(saved, strata::test::tiny_config(stage));
      strata::test::train_tiny(engine, 2);
      engine->save_checkpoint(tmp.str(), "t");
    }
    for (const auto& c : cases) {
      torch::manual_seed(2);
      TinyNet model(c.make());
      auto engine = strata::initialize(model, strata::test::tiny_config(stage, c.bf16));
      const auto before = strata::test::snapshot(*model);
      std::string error = "(no error)";
      try {
        engine->load_checkpoint(tmp.str(), "t");
      } catch (const strata::Error& e) {
        error = e.what();
      }
      for (const auto& part : c.expect)
        EXPECT_NE(error.find(part), std::string::npos)
            << "stage " << stage << ", " << c.what << ": " << error;
      EXPECT_TRUE(strata::test::unchanged(*model, before)) << "stage " << stage << ", " << c.what;
      EXPECT_EQ(engine->global_steps(), 0);
    }
  }
}
