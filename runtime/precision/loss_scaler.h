// strata::LossScaler: the fp16 loss scale, with the semantics of DeepSpeed's DynamicLossScaler
// and LossScaler (static) in deepspeed/runtime/fp16/loss_scaler.py, which ZeRO stages 1-3 use.
// A plain class on bools and doubles: no torch, so its behaviour is tested step by step against
// DeepSpeed's own code (tests/runtime/precision/).
//
// Dynamic scaling, one update_scale(overflow) per optimizer step (DeepSpeed 0.19.8):
//   overflow, and hysteresis spent (delayed_shift == 1 or cur_hysteresis == 1):
//       if cur_scale == min_scale and raise_error_at_min_scale: throw strata::Error (nothing
//       changes); else cur_scale = max(cur_scale / 2, min_scale)
//   overflow, hysteresis left:   cur_hysteresis -= 1 (the scale stays)
//   every overflow:              last_overflow_iter = cur_iter
//   good step:                   consecutive_hysteresis: cur_hysteresis = delayed_shift;
//                                then, if the growth rule fires: cur_scale *= 2, and (without
//                                consecutive_hysteresis) cur_hysteresis = delayed_shift
//   always (unless it threw):    cur_iter += 1
// Growth rule: see GrowthRule. Hysteresis is refilled only as written above: without
// consecutive_hysteresis, only when the scale grows.
//
// The scale starts at 2^initial_scale_power; fp16.loss_scale > 0 makes it static (never
// changes); fp16 disabled gives DeepSpeed's scaler for other dtypes: static 1.
//
// DeepSpeed's stage-0 FP16_Optimizer (fused and unfused) does NOT use this class: it halves the
// scale on every overflow (no hysteresis) and never raises at the minimum. The engine decides
// which behaviour a path follows; this class is the ZeRO one.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "runtime/config/config.h"

namespace strata {

// When a run of good steps doubles the scale. Both count from the last overflow (absorbed
// overflows included) or from the start, where last_overflow_iter is -1.
enum class GrowthRule {
  // DeepSpeed >= 0.17.1 (to 0.19.8, the newest read): with stable_interval =
  // cur_iter - last_overflow_iter - 1 (the good steps BEFORE this one), grow when stable_interval
  // > 0 and stable_interval % scale_window == 0: on the (W+1)-th, (2W+1)-th, ... good step.
  kStableInterval,
  // DeepSpeed <= 0.17.0: grow when (cur_iter - last_overflow_iter) % scale_window == 0: on the
  // W-th, 2W-th, ... good step.
  kLegacyModulo,
};

struct DynamicLossScaleOptions {
  double init_scale = 65536.0;  // 2^initial_scale_power
  int64_t scale_window = 1000;  // fp16.loss_scale_window
  double min_scale = 1.0;       // fp16.min_loss_scale
  int64_t delayed_shift = 2;    // fp16.hysteresis
  bool consecutive_hysteresis = false;
  bool raise_error_at_min_scale = true;  // DeepSpeed's default; its config cannot change it
  GrowthRule growth = GrowthRule::kStableInterval;
};

// What one update_scale() did, for the engine's log line (see describe()).
struct LossScaleUpdate {
  enum class Kind {
    kNone,        // good step, no growth; or an overflow under a static scale
    kGrew,        // good step that doubled the scale
    kReduced,     // overflow that lowered the scale (or found it at a floor it cannot leave)
    kHysteresis,  // overflow absorbed by hysteresis: the scale stays
  };
  Kind kind = Kind::kNone;
  bool overflow = false;
  double prev_scale = 0;
  double new_scale = 0;
  int64_t prev_hysteresis = 0;  // hysteresis before the step (dynamic only)
};

class LossScaler {
 public:
  // DeepSpeed's LossScaler(scale): the scale never changes. Throws unless scale > 0 and finite.
  static LossScaler make_static(double scale);
  // DeepSpeed's DynamicLossScaler. Throws on options that DeepSpeed would turn into a division
  // by zero or a scale that never moves (scale_window < 1, delayed_shift < 1, min_scale <= 0,
  // init_scale <= 0).
  static LossScaler make_dynamic(const DynamicLossScaleOptions& options);
  // DeepSpeed's CreateLossScaler for the config: fp16 disabled -> static 1; loss_scale > 0 ->
  // static loss_scale; loss_scale 0 -> dynamic from initial_scale_power, loss_scale_window,
  // hysteresis, consecutive_hysteresis, min_loss_scale (raise_error_at_min_scale true).
  static LossScaler from_config(const Fp16Config& fp16,
                                GrowthRule growth = GrowthRule::kStableInterval);

  bool dynamic() const { return dynamic_; }
  double cur_scale() const { return cur_scale_; }
  // Dynamic only (static: 0, -1, 0).
  int64_t cur_iter() const { return cur_iter_; }
  int64_t last_overflow_iter() const { return last_overflow_iter_; }
  int64_t cur_hysteresis() const { return cur_hysteresis_; }
  const DynamicLossScaleOptions& options() const { return options_; }

  // Call once per optimizer step with the (all-reduced) overflow flag. Static: nothing changes.
  // Dynamic: see the top of this file; throws strata::Error, changing nothing, on an overflow
  // with the scale already at min_scale (and raise_error_at_min_scale).
  LossScaleUpdate update_scale(bool overflow);

  // {"dynamic", "cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis"} (the last three
  // for a dynamic scaler only). The config, not the state, decides the mode and the options:
  // a static scaler ignores a loaded state (its scale is the configured one); a dynamic scaler
  // continues from a dynamic state exactly (cur_hysteresis capped at a since-lowered
  // fp16.hysteresis), and throws on a static or malformed one.
  nlohmann::json state() const;
  void load_state(const nlohmann::json& state);

 private:
  LossScaler() = default;

  bool dynamic_ = false;
  DynamicLossScaleOptions options_;
  double cur_scale_ = 1.0;
  int64_t cur_iter_ = 0;
  int64_t last_overflow_iter_ = -1;
  int64_t cur_hysteresis_ = 0;
};

// DeepSpeed's log line for an update ("OVERFLOW! Skipping step. Attempted loss scale: 65536,
// reducing to 32768"), or "" when there is nothing to say (good steps; the caller may log
// kGrew itself). The engine prefixes the rank.
std::string describe(const LossScaleUpdate& update);

}  // namespace strata
