#!/usr/bin/env bash
# transport::Mpi's tests under Open MPI's mpirun (as root too: CI runs as root).
#   check.sh suite TEST_MPI RANKS [test_mpi options]   the suite at RANKS ranks
#   check.sh killed TEST_MPI RANKS                     rank 1 SIGKILLed mid-training:
#     plain mpirun must end the whole job, saying which process died (Open MPI's own rule: a process
#     that dies takes the job with it; the time it took is printed, not judged); under
#     --enable-recovery, where Open MPI lets the others go on, every survivor must end with a
#     gradsync::Error, not hang (naming the peer it waited for, or the rank that timed out first:
#     in a ring that need not be rank 1).
set -u
mode=$1 exe=$2 ranks=$3; shift 3
# Oversubscribed on purpose (CI has 2 cores); InfiniBand's openib component only warns where
# there is no such hardware.
mpirun=(mpirun --allow-run-as-root --oversubscribe --mca btl '^openib' -n "$ranks")
case $mode in
  suite) exec "${mpirun[@]}" "$exe" --no-version --no-colors "$@" ;;  # mpirun hands ranks a tty: no colour codes for tools/test-summary
  killed)
    case_name='killed:*'
    start=$(date +%s.%N)
    out=$(timeout 120 "${mpirun[@]}" "$exe" --no-version --no-skip --test-case="$case_name" 2>&1); status=$?
    took=$(python3 -c "import sys; print(round($(date +%s.%N) - $start, 2))")
    echo "$out"
    echo "plain mpirun: status $status after ${took}s"
    if [ "$status" -eq 0 ] || [ "$status" -eq 124 ]; then echo "FAIL: the job did not end with an error"; exit 1; fi
    grep -q "exited on signal 9" <<<"$out" || { echo "FAIL: Open MPI did not say rank 1 was killed"; exit 1; }
    out=$(timeout 120 "${mpirun[@]}" --enable-recovery "$exe" --no-version --no-skip --test-case="$case_name" 2>&1)
    echo "$out"
    for ((r = 0; r < ranks; ++r)); do
      [ "$r" -eq 1 ] && continue
      line=$(grep "^rank $r saw: " <<<"$out") || { echo "FAIL: rank $r reported no gradsync::Error under --enable-recovery"; exit 1; }
      grep -qE "timeout|peer_failed" <<<"$line" || { echo "FAIL: rank $r: $line"; exit 1; }
    done
    echo "killed: ok" ;;
  *) echo "usage: check.sh suite|killed TEST_MPI RANKS [options]" >&2; exit 2 ;;
esac
