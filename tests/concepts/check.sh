#!/usr/bin/env bash
# A policy that does not satisfy its concept must stop the build with a message naming the
# concept, a combination a synchronizer refuses with its reason; the control case must compile (so a failure is not just a broken command line).
#   check.sh SOURCE INCLUDE_DIR... -- COMPILER [FLAGS...]
set -uo pipefail
source=$1; shift
includes=()
while [[ $1 != -- ]]; do includes+=("-I$1"); shift; done
shift
compile() { "$@" -std=c++20 "${includes[@]}" -fsyntax-only "$source"; }
status=0
if ! out=$(compile "$@" -DCASE=0 2>&1); then
  echo "control case does not compile:"; echo "$out"; exit 1
fi
for case in 1:CompressionPolicy 2:TransportPolicy 3:BucketingPolicy 4:TopologyPolicy; do
  n=${case%%:*}; concept=${case#*:}
  if out=$(compile "$@" -DCASE="$n" 2>&1); then
    echo "case $n ($concept) compiled but must not"; status=1
  elif ! grep -Eq "satisf[a-z]* .*$concept" <<<"$out"; then
    # Both GCC ("required for the satisfaction of 'X<C>'") and Clang ("does not satisfy 'X'")
    # name the one concept that failed on a line of its own.
    echo "case $n: the error does not say that $concept is unsatisfied:"; echo "$out" | head -20; status=1
  else
    echo "case $n: rejected, naming $concept"
  fi
done
# A combination the asynchronous parameter server refuses: its static_assert says why.
if out=$(compile "$@" -DCASE=5 2>&1); then
  echo "case 5 (async over an order-matched transport) compiled but must not"; status=1
elif ! grep -q "matching by posting order" <<<"$out"; then
  echo "case 5: the error does not give the reason:"; echo "$out" | head -20; status=1
else
  echo "case 5: async over an order-matched transport rejected, saying why"
fi
exit $status
