// DeepSpeed's LR schedules written out again, independently of runtime/sched/, from
// deepspeed/runtime/lr_schedules.py as of DeepSpeed master edaa722 (2026-08-22, 0.19.6 in
// development): in double and in its order of operations, so that floor() at a stair boundary
// and the clamp at total_num_steps fall the same way. By last_batch_iteration i.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <vector>

namespace ds {

constexpr double kPi = 3.14159265358979323846;  // math.pi

// WarmupLR._get_gamma / WarmupDecayLR._get_gamma.
inline double warmup_gamma(int64_t i, int64_t warmup_num_steps, bool linear,
                           std::optional<int64_t> total_num_steps) {
  const int64_t warmup = std::max<int64_t>(2, warmup_num_steps);
  const double inverse_log_warm_up = 1.0 / std::log(double(warmup));
  if (i < warmup)
    return linear ? double(i) / double(warmup) : inverse_log_warm_up * std::log(double(i + 1));
  if (!total_num_steps) return 1.0;
  return std::max(0.0, double(*total_num_steps - i) /
                           double(std::max(1.0, double(*total_num_steps - warmup))));
}

inline double warmup_lr(int64_t i, double min_lr, double max_lr, int64_t warmup_num_steps,
                        bool linear, std::optional<int64_t> total_num_steps = std::nullopt) {
  if (i < 0) return min_lr;
  const double delta_lr = max_lr - min_lr;
  return min_lr + (delta_lr * warmup_gamma(i, warmup_num_steps, linear, total_num_steps));
}

// WarmupCosineLR.get_lr_ratio (the progress clamp and the span floor are DeepSpeed #8142).
inline double cosine_ratio(int64_t i, double warmup_min_ratio, double cos_min_ratio,
                           int64_t warmup_num_steps, int64_t total_num_steps, bool linear) {
  const int64_t warmup = std::max<int64_t>(2, warmup_num_steps);
  const double inverse_log_warm_up = 1.0 / std::log(double(warmup));
  if (i < 0) return 0.0;
  if (i < warmup) {
    const double ratio =
        linear ? double(i) / double(warmup) : inverse_log_warm_up * std::log(double(i + 1));
    const double ratio_delta = 1. - warmup_min_ratio;
    return warmup_min_ratio + ratio * ratio_delta;
  }
  const int64_t real_last_step = i - warmup + 1;
  const int64_t real_total_steps = std::max<int64_t>(1, total_num_steps - warmup);
  const double cosine_progress = std::min(1.0, double(real_last_step) / double(real_total_steps));
  const double ratio_delta = 1. - cos_min_ratio;
  const double ratio = (1 + std::cos(kPi * cosine_progress)) / 2;
  return std::max(0.0, cos_min_ratio + ratio_delta * ratio);
}

// OneCycle, per param group (lists: DeepSpeed #8201), with stairs (DeepSpeed #8179).
struct OneCycle {
  std::vector<double> min_lrs{0.01}, max_lrs{0.1}, min_moms{0.85}, max_moms{0.95};
  double first = 10, second = 5;  // cycle_first_step_size, cycle_second_step_size
  int64_t first_stairs = 0;
  std::optional<int64_t> second_stairs;  // None: first_stairs
  double decay_step_size = 4, decay_lr_rate = 0.5, decay_mom_rate = 0.1;

  // The config: one number for one group, else one per group.
  nlohmann::json to_json(bool cycle_momentum = true) const {
    auto value = [](const std::vector<double>& v) {
      return v.size() == 1 ? nlohmann::json(v[0]) : nlohmann::json(v);
    };
    nlohmann::json second_count = nullptr;
    if (second_stairs) second_count = *second_stairs;
    return {{"cycle_min_lr", value(min_lrs)},          {"cycle_max_lr", value(max_lrs)},
            {"decay_lr_rate", decay_lr_rate},          {"cycle_first_step_size", first},
            {"cycle_second_step_size", second},        {"cycle_first_stair_count", first_stairs},
            {"cycle_second_stair_count", second_count}, {"decay_step_size", decay_step_size},
            {"cycle_momentum", cycle_momentum},        {"cycle_min_mom", value(min_moms)},
            {"cycle_max_mom", value(max_moms)},        {"decay_mom_rate", decay_mom_rate}};
  }

  // _get_scale_factor
  double scale_factor(int64_t i) const {
    const double total_size = first + second;
    const double step_ratio = first / total_size;
    const int64_t batch_iteration = i + 1;
    const double cycle = std::floor(1 + double(batch_iteration) / total_size);
    const double x = 1. + double(batch_iteration) / total_size - cycle;
    double scale;
    int64_t stair_count;
    if (x <= step_ratio) {
      scale = x / step_ratio;
      stair_count = first_stairs;
    } else {
      scale = (x - 1) / (step_ratio - 1);
      stair_count = second_stairs.value_or(first_stairs);
    }
    if (stair_count > 0) {
      const double cycle_iteration = std::fmod(double(batch_iteration), total_size);  // b >= 0
      const double stair_position =
          cycle_iteration <= first ? cycle_iteration * double(stair_count) / first
                                   : (total_size - cycle_iteration) * double(stair_count) / second;
      scale = std::floor(stair_position) / double(stair_count);
    }
    return scale;
  }

  std::vector<double> lr(int64_t i) const {
    std::vector<double> out;
    if (double(i) < first + second) {  // _get_cycle_lr
      for (size_t g = 0; g < min_lrs.size(); ++g)
        out.push_back(min_lrs[g] + (max_lrs[g] - min_lrs[g]) * scale_factor(i));
      return out;
    }
    if (decay_step_size == 0 || decay_lr_rate == 0) return min_lrs;  // skip_lr_decay
    const double decay_interval = (double(i) - (first + second) + 1) / decay_step_size;
    const double lr_decay_factor = 1 + decay_lr_rate * decay_interval;
    for (double min_lr : min_lrs) out.push_back(min_lr / lr_decay_factor);
    return out;
  }

  // beta1 of each group; the constructor writes cycle_min_mom.
  std::vector<double> mom(int64_t i) const {
    if (i < 0) return min_moms;
    std::vector<double> out;
    if (double(i) < first + second) {  // _get_cycle_mom
      for (size_t g = 0; g < min_moms.size(); ++g)
        out.push_back(max_moms[g] - (max_moms[g] - min_moms[g]) * scale_factor(i));
      return out;
    }
    if (decay_step_size == 0 || decay_mom_rate == 0) return max_moms;  // skip_mom_decay
    const double decay_interval = (double(i) - (first + second) + 1) / decay_step_size;
    const double mom_decay_factor = 1 + decay_mom_rate * decay_interval;
    for (double max_mom : max_moms) out.push_back(max_mom * mom_decay_factor);
    return out;
  }
};

// LRRangeTest.get_lr
inline double range_test_lr(int64_t i, double min_lr, double step_size, double step_rate,
                            bool staircase) {
  double interval = double(i + 1) / step_size;
  if (staircase) interval = std::floor(interval);
  return min_lr * (1 + step_rate * interval);
}

}  // namespace ds
