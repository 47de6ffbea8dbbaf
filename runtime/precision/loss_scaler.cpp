#include "runtime/precision/loss_scaler.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "runtime/error.h"

namespace strata {
namespace {

constexpr double kScaleFactor = 2.0;  // DeepSpeed fixes it (DynamicLossScaler.scale_factor)

bool positive_finite(double x) { return std::isfinite(x) && x > 0; }

const nlohmann::json& state_field(const nlohmann::json& state, const char* key) {
  if (!state.contains(key))
    throw Error(
        fmt::format("loss scaler state: \"{}\" is missing (state: {}); pass the object that "
                    "LossScaler::state() wrote",
                    key, state.dump()));
  return state.at(key);
}

int64_t state_int(const nlohmann::json& state, const char* key) {
  const auto& v = state_field(state, key);
  if (!v.is_number_integer())
    throw Error(fmt::format("loss scaler state: \"{}\" must be an integer, got {}", key, v.dump()));
  return v.get<int64_t>();
}

}  // namespace

LossScaler LossScaler::make_static(double scale) {
  if (!positive_finite(scale))
    throw Error(fmt::format("static loss scale must be a positive finite number, got {}", scale));
  LossScaler s;
  s.cur_scale_ = scale;
  return s;
}

LossScaler LossScaler::make_dynamic(const DynamicLossScaleOptions& o) {
  if (!positive_finite(o.init_scale))
    throw Error(
        fmt::format("dynamic loss scaling: the initial scale must be a positive finite "
                    "number, got {} (fp16.initial_scale_power)",
                    o.init_scale));
  if (o.scale_window < 1)
    throw Error(
        fmt::format("dynamic loss scaling: the scale window must be >= 1, got {} "
                    "(fp16.loss_scale_window)",
                    o.scale_window));
  if (o.delayed_shift < 1)
    throw Error(
        fmt::format("dynamic loss scaling: hysteresis must be >= 1, got {} "
                    "(fp16.hysteresis; 1 = lower the scale on every overflow)",
                    o.delayed_shift));
  if (!positive_finite(o.min_scale))
    throw Error(
        fmt::format("dynamic loss scaling: the minimum scale must be a positive finite "
                    "number, got {} (fp16.min_loss_scale)",
                    o.min_scale));
  LossScaler s;
  s.dynamic_ = true;
  s.options_ = o;
  s.cur_scale_ = o.init_scale;
  s.cur_hysteresis_ = o.delayed_shift;
  return s;
}

LossScaler LossScaler::from_config(const Fp16Config& fp16, GrowthRule growth) {
  if (!fp16.enabled) return make_static(1.0);
  if (fp16.loss_scale > 0) return make_static(fp16.loss_scale);
  DynamicLossScaleOptions o;
  o.init_scale = std::ldexp(1.0, static_cast<int>(fp16.initial_scale_power));
  o.scale_window = fp16.loss_scale_window;
  o.min_scale = fp16.min_loss_scale;
  o.delayed_shift = fp16.hysteresis;
  o.consecutive_hysteresis = fp16.consecutive_hysteresis;
  o.growth = growth;
  return make_dynamic(o);
}

LossScaleUpdate LossScaler::update_scale(bool overflow) {
  LossScaleUpdate u;
  u.overflow = overflow;
  u.prev_scale = cur_scale_;
  u.prev_hysteresis = cur_hysteresis_;
  if (!dynamic_) {
    u.new_scale = cur_scale_;
    return u;
  }
  const auto& o = options_;
  if (overflow) {
    if (o.delayed_shift == 1 || cur_hysteresis_ == 1) {
      if (cur_scale_ == o.min_scale && o.raise_error_at_min_scale)
        throw Error(fmt::format(
            "fp16 dynamic loss scaling: the gradients overflowed at iteration {} with the loss "
            "scale already at its minimum (fp16.min_loss_scale = {}), so it cannot decrease any "
            "further (DeepSpeed: \"Current loss scale already at minimum - cannot decrease scale "
            "anymore. Exiting run.\"). The gradients are inf/NaN even at the lowest scale: look "
            "for the source (learning rate, data, a diverging loss) or train in bf16",
            cur_iter_, o.min_scale));
      cur_scale_ = std::max(cur_scale_ / kScaleFactor, o.min_scale);
      u.kind = LossScaleUpdate::Kind::kReduced;
    } else {
      cur_hysteresis_ -= 1;
      u.kind = LossScaleUpdate::Kind::kHysteresis;
    }
    last_overflow_iter_ = cur_iter_;
  } else {
    if (o.consecutive_hysteresis) cur_hysteresis_ = o.delayed_shift;
    bool grow = false;
    if (o.growth == GrowthRule::kStableInterval) {
      const int64_t stable_interval = (cur_iter_ - last_overflow_iter_) - 1;
      grow = stable_interval > 0 && stable_interval % o.scale_window == 0;
    } else {
      grow = (cur_iter_ - last_overflow_iter_) % o.scale_window == 0;
    }
    if (grow) {
      if (!o.consecutive_hysteresis) cur_hysteresis_ = o.delayed_shift;
      cur_scale_ *= kScaleFactor;
      u.kind = LossScaleUpdate::Kind::kGrew;
    }
  }
  cur_iter_ += 1;
  u.new_scale = cur_scale_;
  return u;
}

nlohmann::json LossScaler::state() const {
  nlohmann::json j = {{"dynamic", dynamic_}, {"cur_scale", cur_scale_}};
  if (dynamic_) {
    j["cur_iter"] = cur_iter_;
    j["last_overflow_iter"] = last_overflow_iter_;
    j["cur_hysteresis"] = cur_hysteresis_;
  }
  return j;
}

void LossScaler::load_state(const nlohmann::json& state) {
  if (!state.is_object())
    throw Error(fmt::format("loss scaler state must be a JSON object, got {}", state.dump()));
  const auto& dyn = state_field(state, "dynamic");
  if (!dyn.is_boolean())
    throw Error(
        fmt::format("loss scaler state: \"dynamic\" must be true or false, got {}", dyn.dump()));
  const auto& scale = state_field(state, "cur_scale");
  if (!scale.is_number() || !positive_finite(scale.get<double>()))
    throw Error(fmt::format("loss scaler state: \"cur_scale\" must be a positive number, got {}",
                            scale.dump()));
  if (!dynamic_) return;  // a static scale comes from the config
  if (!dyn.get<bool>())
    throw Error(fmt::format(
        "loss scaler state: the checkpoint used a static loss scale ({}) but the config asks for "
        "dynamic scaling (fp16.loss_scale = 0); there is no dynamic state to continue from. Set "
        "fp16.loss_scale to the static value, or resume without the loss scaler's state",
        scale.dump()));
  const int64_t iter = state_int(state, "cur_iter");
  const int64_t last = state_int(state, "last_overflow_iter");
  const int64_t hyst = state_int(state, "cur_hysteresis");
  if (iter < 0 || last < -1 || last >= iter)
    throw Error(
        fmt::format("loss scaler state: cur_iter {} and last_overflow_iter {} must satisfy "
                    "-1 <= last_overflow_iter < cur_iter",
                    iter, last));
  if (hyst < 1)
    throw Error(fmt::format("loss scaler state: cur_hysteresis must be >= 1, got {}", hyst));
  cur_scale_ = scale.get<double>();
  cur_iter_ = iter;
  last_overflow_iter_ = last;
  // A config that lowered fp16.hysteresis since the save caps what is left of it.
  cur_hysteresis_ = std::min(hyst, options_.delayed_shift);
}

std::string describe(const LossScaleUpdate& u) {
  switch (u.kind) {
    case LossScaleUpdate::Kind::kReduced:
      return fmt::format("OVERFLOW! Skipping step. Attempted loss scale: {}, reducing to {}",
                         u.prev_scale, u.new_scale);
    case LossScaleUpdate::Kind::kHysteresis:
      return fmt::format(
          "OVERFLOW! Skipping step. Attempted loss scale: {}, but hysteresis is {}. Reducing "
          "hysteresis to {}",
          u.prev_scale, u.prev_hysteresis, u.prev_hysteresis - 1);
    case LossScaleUpdate::Kind::kGrew:
    case LossScaleUpdate::Kind::kNone:
      break;
  }
  if (u.overflow)  // a static scale: DeepSpeed's LossScalerBase.update_scale message
    return "OVERFLOW! Skipping step. Gradients are non-finite, weights were not updated.";
  return "";
}

}  // namespace strata
