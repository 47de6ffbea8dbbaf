#!/usr/bin/env bash
# A crash on the device, traced: builds TARGET (a test binary, unstripped in /tmp/sb), runs each
# gtest case of FILTER (a --gtest_filter pattern) under crash_trace.so and turns the frames in
# the test binary into functions and lines (addr2line). Session 38: test_engine_zenflow's three
# resume tests crash after the checkpoint loads (CUDA build, LibTorch 2.11; CPU tensors).
#   TARGET=test_engine_zenflow FILTER='ZenFlow.*Resume*:ZenFlow.ACheckpoint*' bash bench/device/call_trace.sh
set -uo pipefail
export TARGETS="${TARGET:?}"
source bench/device/setup.sh || exit 1
gcc -O1 -g -shared -fPIC -o /tmp/crash_trace.so bench/device/crash_trace.c || exit 1
bin=/tmp/sb/bin/$TARGET
for c in $($bin --gtest_list_tests --gtest_filter="${FILTER:-*}" | awk '/^[^ ]/{s=$1} /^  /{print s $1}'); do
  LD_PRELOAD=/tmp/crash_trace.so timeout 120 $bin --gtest_filter="$c" > /tmp/t.log 2>&1
  echo "$c rc $?"
  grep -A60 '^\*\*\* signal' /tmp/t.log | grep -v -- '-p \|^[0-9a-f]*-[0-9a-f]* ' | head -60
  # The test binary's frames: binary(+0xOFFSET) -> function, file:line.
  grep -o "$TARGET(+0x[0-9a-f]*)" /tmp/t.log | grep -o '0x[0-9a-f]*' | xargs -r addr2line -f -C -i -e $bin | head -80
done
