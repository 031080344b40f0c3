#!/usr/bin/env bash
# Builds the fuzz targets of this folder with clang's libFuzzer, AddressSanitizer and
# UndefinedBehaviorSanitizer, and runs each for SECONDS seconds from its corpus
# (corpus/TARGET/; what the run finds goes to a scratch folder, not into the repository). Prints
# one line per target: inputs executed, and whether it crashed (the crashing input is kept in WORK).
#   run.sh CLANGXX SOURCE_ROOT BUILD_INCLUDE WORK SECONDS [TARGET...]
# BUILD_INCLUDE is a build's include/ folder (the generated version.hpp). The long run is the same
# with more seconds, e.g. 3600 (tests/fuzz/README.md).
set -uo pipefail
cxx=$1 root=$2 build_include=$3 work=$4 seconds=$5
shift 5
targets=("$@")
((${#targets[@]})) || targets=(tcp_wire control codecs trace environment idx)
flags=(-std=c++20 -g -O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -I"$root/include"
  -I"$build_include" -I"$root/src" -I"$root/bench" -I"$root/examples/fmnist")
# The library code the targets reach, compiled once with coverage for the fuzzer.
library=(src/error.cpp src/types.cpp src/schedule.cpp src/engine/control.cpp src/transport/tcp/wire.cpp
  src/detail/hmac.cpp src/launch/environment.cpp examples/fmnist/idx.cpp)
mkdir -p "$work/objects"
# A compiler without libFuzzer's runtime (Debian: libclang-rt-14-dev) cannot take part: skip.
echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' >"$work/probe.cpp"
if ! "$cxx" -fsanitize=fuzzer "$work/probe.cpp" -o "$work/probe" 2>/dev/null; then
  echo "fuzz: $cxx cannot build a libFuzzer target here; skipped"
  exit 77
fi
objects=()
for source in "${library[@]}"; do
  object=$work/objects/${source//\//_}.o
  "$cxx" "${flags[@]}" -fsanitize=fuzzer-no-link -c "$root/$source" -o "$object" || { echo "fuzz: compiling $source failed"; exit 1; }
  objects+=("$object")
done
failed=0
for target in "${targets[@]}"; do
  if ! "$cxx" "${flags[@]}" -fsanitize=fuzzer "$root/tests/fuzz/$target.cpp" "${objects[@]}" -lfmt -lsodium -lz \
    -o "$work/$target"; then
    echo "fuzz $target: does not build"
    failed=1
    continue
  fi
  rm -rf "$work/found-$target" && mkdir -p "$work/found-$target"
  if "$work/$target" -max_total_time="$seconds" -rss_limit_mb=2048 -artifact_prefix="$work/$target-" \
    "$work/found-$target" "$root/tests/fuzz/corpus/$target" >"$work/$target.log" 2>&1; then
    echo "fuzz $target: $(grep -o 'Done [0-9]* runs' "$work/$target.log" | tail -1 | tr -dc 0-9) inputs in $seconds s, no crash"
  else
    echo "fuzz $target: CRASHED (input kept as $work/$target-*)"
    tail -40 "$work/$target.log"
    failed=1
  fi
done
exit $failed
