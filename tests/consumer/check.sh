#!/usr/bin/env bash
# Builds tests/consumer with this checkout as its gradsync subproject, then runs it.
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
meson setup build --wrap-mode=nodownload
meson compile -C build
output=$(./build/consumer)
echo "$output"
[[ $output == "gradsync "*": 2 3 4" ]]
