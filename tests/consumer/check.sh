#!/usr/bin/env bash
# Builds tests/consumer with this checkout as its gradsync subproject, then runs it; then builds
# the same program with nothing but the flags gradsync.pc gives (pkg-config, from the subproject's
# uninstalled .pc) and -Wall -Wextra -Wpedantic -Werror, and runs that too; then installs gradsync
# (`meson install` into a staging directory) and builds and runs it once more from the installed
# headers, libraries and .pc alone.
#   check.sh SOURCE_ROOT WORK_DIR
set -euo pipefail
source_root=$1
work=$2
rm -rf "$work"
mkdir -p "$work/subprojects"
cp -r "$source_root/tests/consumer/." "$work/"
rm -f "$work/check.sh"
ln -s "$source_root" "$work/subprojects/gradsync"
cd "$work"
# At CI's own level (tools/run-tests: -O1, no debug information), which compiles in about half
# the time of Meson's default (-O2 -g); the level is not what this test checks. Without the CUDA
# and MPI companion libraries: the checkout's own build compiles them with warnings as errors, and
# a consumer of the core library neither names nor links them (nvcc alone took about a minute of
# this test's 2-3).
meson setup build --wrap-mode=nodownload -Doptimization=1 -Ddebug=false -Dgradsync:cuda=disabled -Dgradsync:mpi=disabled
meson compile -C build
expected="*: 2 3 4, two-bit 1 0 0"
output=$(./build/consumer)
echo "$output"
[[ $output == gradsync\ $expected ]]

export PKG_CONFIG_PATH=$work/build/meson-uninstalled${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
flags=$(pkg-config --cflags --libs gradsync)
echo "pkg-config: $flags"
# The library's directory: the uninstalled .pc names it for the linker only.
libdir=$(dirname "$(find build -name 'libgradsync.so' | head -1)")
compilers=(c++)
command -v clang++ >/dev/null && compilers+=(clang++)  # where present: clang holds headers to other rules
compiling=()  # side by side: each compile is one core's
for compiler in "${compilers[@]}"; do
  "$compiler" -Wall -Wextra -Wpedantic -Werror src/main.cpp $flags -pthread -o "consumer-pkgconfig-$compiler" &
  compiling+=($!)
done
for pid in "${compiling[@]}"; do wait "$pid"; done
for compiler in "${compilers[@]}"; do
  output=$(LD_LIBRARY_PATH=$libdir "./consumer-pkgconfig-$compiler")
  echo "$compiler: $output"
  [[ $output == gradsync\ $expected ]]
done

# Installed: what `meson install` puts under a prefix, found through its gradsync.pc only.
stage=$work/stage
meson install -C build --destdir "$stage" --quiet
pc=$(dirname "$(find "$stage" -name gradsync.pc | head -1)")
# Only the staged .pc (pkg-config would prefer the build tree's gradsync-uninstalled.pc), read
# with the staging directory as its root.
export PKG_CONFIG_PATH=$pc PKG_CONFIG_DISABLE_UNINSTALLED=1 PKG_CONFIG_SYSROOT_DIR=$stage
flags=$(pkg-config --cflags --libs gradsync)
echo "installed pkg-config: $flags"
[[ $flags == *"-I$stage/"* ]]  # the staged headers, not this checkout's
c++ -Wall -Wextra -Wpedantic -Werror src/main.cpp $flags -pthread -o consumer-installed
libdir=$(dirname "$(find "$stage" -name 'libgradsync.so' | head -1)")
output=$(LD_LIBRARY_PATH=$libdir ./consumer-installed)
echo "installed: $output"
[[ $output == gradsync\ $expected ]]
