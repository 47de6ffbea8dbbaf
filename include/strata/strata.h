// Strata's public include: everything a user's program needs to train its own LibTorch model.
//
//   #include <strata/strata.h>
//
//   auto engine = strata::initialize(model, "ds_config.json");
//   auto loss = engine->forward(x, y);  engine->backward(loss);  engine->step();
//
// What it brings: the engine (strata::initialize, strata::InitOptions, strata::Engine), the
// optimizer and LR-schedule registries (strata::register_optimizer, ...), checkpoints
// (engine->save_checkpoint / load_checkpoint, strata::checkpoint::consolidate), Hugging Face
// folders in and out (strata::checkpoint::import_weights, HfWeights, export_hf_folder), monitors, the
// fused linear head + cross-entropy (strata::nn::linear_cross_entropy), the config types,
// strata::Error, and the version (strata/version.h). Models of published architectures:
// <strata/models.h>.
//
// The engine is a template over the user's module, so its headers (runtime/, zero/, comm/) come
// along: they are installed under include/strata/ as an implementation detail, reached through
// this header only. Include this one; the paths below it may change between versions.
#pragma once

#include "strata/version.h"

#include "moe/layer.h"
#include "runtime/checkpoint/consolidate.h"
#include "runtime/checkpoint/hf_export.h"
#include "runtime/checkpointing/checkpoint.h"
#include "runtime/util/tiled.h"
#include "runtime/config/config.h"
#include "runtime/device_memory.h"
#include "runtime/engine.h"
#include "runtime/error.h"
#include "runtime/monitor/monitor.h"
#include "runtime/nn/linear_cross_entropy.h"
#include "runtime/optim/registry.h"
#include "runtime/sched/registry.h"
#include "runtime/sequence/ulysses.h"
#include "comm/topology.h"
