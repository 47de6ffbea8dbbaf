// Strata's models of published architectures: Llama-3 and Qwen3 as plain LibTorch modules built
// from a Hugging Face config.json (strata::models::read_hf_config, strata::models::CausalLM).
//
//   #include <strata/strata.h>
//   #include <strata/models.h>
//
//   auto config = strata::models::read_hf_config("Llama-3.2-1B/config.json");
//   strata::models::CausalLM model(config);
//   auto engine = strata::initialize(model, "ds_config.json");
//   engine->backward(engine->forward(input_ids, labels));  engine->step();
//
// Linked by Strata::strata. The paths below may change between versions; include this header.
#pragma once

#include "models/causal_lm.h"
#include "models/hf_config.h"
#include "models/rope.h"
