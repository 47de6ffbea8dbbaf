# Runtime options of the sanitized suite (sourced by scripts/test.sh before ctest runs in
# build-asan/). Every process a test starts (the ranks a test binary re-runs itself as,
# strata-run and what it launches, train_gpt, strata-ckpt) inherits them, and in that build
# folder every such binary is instrumented too.
# ASan: leaks checked at each process's exit (none suppressed: the suite runs clean); static
# initializers that read another translation unit's global before it is constructed are errors.
export ASAN_OPTIONS="detect_leaks=1:check_initialization_order=1:strict_init_order=1:\
detect_stack_use_after_return=0:print_summary=1:color=never"
# UBSan: every check is fatal at compile time already (-fno-sanitize-recover=all); stacks printed.
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:color=never"
# TSan (the tsan stage: comm, the launcher, the NVMe store): every report is fatal; tsan.supp
# lists the false reports caused by uninstrumented libraries, each with its reason.
export TSAN_OPTIONS="suppressions=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/tsan.supp:\
halt_on_error=1:second_deadlock_stack=1:print_suppressions=0:color=never"
