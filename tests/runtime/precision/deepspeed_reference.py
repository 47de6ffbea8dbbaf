#!/usr/bin/env python3
"""Reference loss-scale sequences for tests/runtime/precision/loss_scaler_test.cpp.

Writes deepspeed_reference_data.h (to stdout): for each scenario, the options, the overflow
pattern, and after every update_scale() call DeepSpeed's cur_scale, cur_hysteresis and
last_overflow_iter, or the step at which it raised "Current loss scale already at minimum".

Source read: DeepSpeed's deepspeed/runtime/fp16/loss_scaler.py, DynamicLossScaler.update_scale,
from the PyPI sdists (`pip download deepspeed==V --no-deps --no-binary :all:`):
  - 0.19.8 (newest; the same update_scale logic in 0.17.1, 0.17.2, 0.17.3, 0.17.6, 0.18.0,
    0.19.0): the "stable_interval" growth rule -> update_scale_current below;
  - 0.17.0 (identical file in 0.14.0; also GitHub microsoft/DeepSpeed at commit 03365187): the
    "(cur_iter - last_overflow_iter) % scale_window" growth rule -> update_scale_legacy below.
The two functions are line-for-line ports of those methods without the log calls.

With --deepspeed-current / --deepspeed-legacy PATH/TO/loss_scaler.py the script also runs the
real DeepSpeed file (torch, deepspeed.comm and logging stubbed: update_scale only compares
dtype with torch.half and asks dist.get_rank() for its log line) and asserts that every
sequence is identical to the port's. Regenerate with:
  python3 deepspeed_reference.py \
      --deepspeed-current deepspeed-0.19.8/deepspeed/runtime/fp16/loss_scaler.py \
      --deepspeed-legacy deepspeed-0.17.0/deepspeed/runtime/fp16/loss_scaler.py \
      > deepspeed_reference_data.h
"""

import argparse
import importlib.util
import random
import sys
import types


class MinScaleError(Exception):
    pass


class PortedDynamicLossScaler:
    """DeepSpeed's DynamicLossScaler state and update_scale, ported."""

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis,
                 raise_error_at_min_scale, legacy):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale
        self.legacy = legacy

    def update_scale(self, overflow):
        if self.legacy:
            self.update_scale_legacy(overflow)
        else:
            self.update_scale_current(overflow)

    # DeepSpeed 0.17.1 .. 0.19.8
    def update_scale_current(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise MinScaleError(
                        "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
                else:
                    next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                    self.cur_scale = next_scale
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift

            stable_interval = (self.cur_iter - self.last_overflow_iter) - 1
            if (stable_interval > 0) and (stable_interval % self.scale_window == 0):
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    # DeepSpeed 0.14.0 .. 0.17.0
    def update_scale_legacy(self, overflow):
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if (self.cur_scale == self.min_scale) and self.raise_error_at_min_scale:
                    raise MinScaleError(
                        "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
                else:
                    next_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
                    self.cur_scale = next_scale
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1


def load_real_deepspeed(path, name):
    """Executes DeepSpeed's own loss_scaler.py with its imports stubbed (no torch needed)."""
    torch = types.ModuleType("torch")
    torch.half = torch.float16 = "float16"
    torch.bfloat16 = "bfloat16"
    torch.float32 = "float32"
    logger = types.SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None)
    ds = types.ModuleType("deepspeed")
    comm = types.ModuleType("deepspeed.comm")
    comm.get_rank = lambda: 0
    utils = types.ModuleType("deepspeed.utils")
    utils.logger = logger
    utils.log_dist = lambda *a, **k: None
    runtime = types.ModuleType("deepspeed.runtime")
    config_utils = types.ModuleType("deepspeed.runtime.config_utils")
    config_utils.DeepSpeedConfigObject = type("DeepSpeedConfigObject", (object, ), {})
    rt_utils = types.ModuleType("deepspeed.runtime.utils")
    rt_utils.has_inf_or_nan = lambda x: False
    ds.comm, ds.utils, ds.runtime = comm, utils, runtime
    saved = {k: sys.modules.get(k) for k in ("torch", "deepspeed", "deepspeed.comm", "deepspeed.utils",
                                             "deepspeed.runtime", "deepspeed.runtime.config_utils",
                                             "deepspeed.runtime.utils")}
    sys.modules.update({
        "torch": torch, "deepspeed": ds, "deepspeed.comm": comm, "deepspeed.utils": utils,
        "deepspeed.runtime": runtime, "deepspeed.runtime.config_utils": config_utils,
        "deepspeed.runtime.utils": rt_utils
    })
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


# name, init_scale, window, min_scale, hysteresis, consecutive, raise_at_min, overflow steps, steps
def scenarios():
    rnd = random.Random(20240611)
    noisy = [i for i in range(120) if rnd.random() < 0.18]
    burst = [i for i in range(120) if rnd.random() < 0.35]
    return [
        ("no_hysteresis_window4", 2.0**16, 4, 1.0, 1, False, True, [0, 1, 7, 8, 20, 33], 40),
        ("window1_grows_every_good_step", 2.0**10, 1, 1.0, 1, False, True, [3, 4, 10, 25], 40),
        ("hysteresis2", 2.0**16, 3, 1.0, 2, False, True, [2, 5, 6, 7, 15, 16, 30, 31, 32], 40),
        ("hysteresis2_consecutive", 2.0**16, 3, 1.0, 2, True, True, [2, 5, 6, 7, 15, 16, 30, 31, 32], 40),
        ("hysteresis3_consecutive_window5", 2.0**16, 5, 1.0, 3, True, True,
         [1, 3, 4, 10, 11, 12, 25, 26, 27, 28], 40),
        ("hysteresis3_window5", 2.0**16, 5, 1.0, 3, False, True, [1, 3, 4, 10, 11, 12, 25, 26, 27, 28], 40),
        ("hysteresis_refilled_only_by_growth", 2.0**12, 6, 1.0, 3, False, True, [0, 8, 9, 20, 29, 30], 40),
        ("deepspeed_defaults_window1000", 2.0**16, 1000, 1.0, 2, False, True, [0, 1, 2, 9, 10, 11, 39], 40),
        ("min_floor_no_raise", 8.0, 6, 2.0, 1, False, False, [0, 1, 2, 3, 4, 12, 13, 14, 15, 30], 40),
        ("min_floor_not_power_of_two", 16.0, 4, 3.0, 2, False, False, [0, 1, 2, 3, 4, 5, 6, 14, 15, 16], 40),
        ("min_scale_raises", 8.0, 4, 1.0, 1, False, True, [0, 1, 9, 10, 11, 20, 21], 40),
        ("min_scale_raises_after_hysteresis", 4.0, 3, 1.0, 2, False, True, [0, 1, 2, 3, 8, 9, 10, 11], 40),
        ("min_scale_raises_consecutive", 4.0, 3, 1.0, 2, True, True, [0, 1, 2, 4, 5, 7, 8, 9], 40),
        ("fractional_min_scale", 1.0, 2, 0.25, 1, False, True, [0, 1, 2, 5, 6, 7], 40),
        ("random_hysteresis2_window7", 2.0**16, 7, 1.0, 2, False, True, noisy, 120),
        ("random_hysteresis2_consecutive_window3", 2.0**16, 3, 1.0, 2, True, True, noisy, 120),
        ("random_bursts_hysteresis4_window2", 2.0**20, 2, 1.0, 4, False, False, burst, 120),
    ]


def run(make, flags):
    s = make()
    scales, hyst, last = [], [], []
    throws_at = -1
    for i, f in enumerate(flags):
        try:
            s.update_scale(f)
        except Exception as e:  # the real class raises a plain Exception
            if "already at minimum" not in str(e):
                raise
            throws_at = i
            break
        scales.append(float(s.cur_scale))
        hyst.append(int(s.cur_hysteresis))
        last.append(int(s.last_overflow_iter))
    return scales, hyst, last, throws_at


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepspeed-current", help="DeepSpeed >= 0.17.1 loss_scaler.py to cross-check")
    ap.add_argument("--deepspeed-legacy", help="DeepSpeed <= 0.17.0 loss_scaler.py to cross-check")
    args = ap.parse_args()
    real = {}
    if args.deepspeed_current:
        real[False] = load_real_deepspeed(args.deepspeed_current, "ds_loss_scaler_current")
    if args.deepspeed_legacy:
        real[True] = load_real_deepspeed(args.deepspeed_legacy, "ds_loss_scaler_legacy")

    out = []
    out.append("// Generated by tests/runtime/precision/deepspeed_reference.py; do not edit.")
    checked = ", ".join(("DeepSpeed's own loss_scaler.py (%s)" % ("legacy" if k else "current"))
                        for k in sorted(real)) or "nothing"
    out.append("// Sequences from the script's port of DeepSpeed's DynamicLossScaler.update_scale; "
               "cross-checked against")
    out.append("// " + checked + ".")
    out.append("#pragma once\n")
    out.append("#include <cstdint>\n#include <vector>\n")
    out.append("namespace ds_ref {\n")
    out.append("struct Scenario {")
    out.append("  const char* name;")
    out.append("  bool legacy;  // growth rule of DeepSpeed <= 0.17.0")
    out.append("  double init_scale;")
    out.append("  int64_t scale_window;")
    out.append("  double min_scale;")
    out.append("  int64_t hysteresis;")
    out.append("  bool consecutive_hysteresis;")
    out.append("  bool raise_error_at_min_scale;")
    out.append("  const char* overflows;  // one '0' / '1' per step")
    out.append("  std::vector<double> scale;  // cur_scale after each step")
    out.append("  std::vector<int64_t> hysteresis_after;  // cur_hysteresis after each step")
    out.append("  std::vector<int64_t> last_overflow_iter;  // after each step")
    out.append("  int64_t throws_at;  // step whose update_scale raised at the minimum, or -1")
    out.append("};\n")
    out.append("inline const std::vector<Scenario>& scenarios() {")
    out.append("  static const std::vector<Scenario> all = {")
    for legacy in (False, True):
        for (name, init, window, mn, h, consec, raise_, ov, steps) in scenarios():
            flags = [i in set(ov) for i in range(steps)]
            args_ = dict(init_scale=init, scale_window=window, min_scale=mn, delayed_shift=h,
                         consecutive_hysteresis=consec, raise_error_at_min_scale=raise_)
            ref = run(lambda: PortedDynamicLossScaler(legacy=legacy, **args_), flags)
            if legacy in real:
                got = run(lambda: real[legacy].DynamicLossScaler(**args_), flags)
                if got != ref:
                    sys.exit("MISMATCH with DeepSpeed's own code in %s (legacy=%s)" % (name, legacy))
            scales, hyst, last, throws_at = ref
            pattern = "".join("1" if f else "0" for f in flags)
            out.append("      {\"%s\", %s, %r, %d, %r, %d, %s, %s,\n       \"%s\",\n"
                       "       {%s},\n       {%s},\n       {%s},\n       %d}," %
                       (name, "true" if legacy else "false", init, window, mn, h,
                        "true" if consec else "false", "true" if raise_ else "false", pattern,
                        ", ".join(repr(x) for x in scales), ", ".join(str(x) for x in hyst),
                        ", ".join(str(x) for x in last), throws_at))
    out.append("  };")
    out.append("  return all;")
    out.append("}\n")
    out.append("}  // namespace ds_ref")
    print("\n".join(out))


if __name__ == "__main__":
    main()
