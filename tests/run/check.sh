#!/usr/bin/env bash
# gradsync-run end to end: a job that works, a job with a failing rank, and ranks started without
# the launcher's variables.
#   check.sh GRADSYNC_RUN PROBE
set -uo pipefail
run=$1
probe=$2
status=0
fail() { echo "FAIL: $*"; status=1; }

out=$(timeout 120 "$run" -n 3 "$probe" 2>&1); rc=$?
echo "$out"
[[ $rc -eq 0 ]] || fail "a working job exited with $rc"
for r in 0 1 2; do
  grep -q "^\[$r\] rank $r of 3: average ok$" <<<"$out" || fail "no prefixed success line from rank $r"
done

out=$(timeout 120 "$run" -n 3 "$probe" --fail-rank 1 2>&1); rc=$?
echo "$out"
[[ $rc -eq 3 ]] || fail "a job whose rank 1 exits with 3 ended with $rc (124 means the others were not stopped)"
grep -q "rank 1 exited with status 3; stopping the other ranks" <<<"$out" || fail "no word about the failed rank"

# Ranks that exit at the same moment, while the others are being stopped: never a traceback.
for attempt in $(seq 40); do
  out=$(timeout 60 "$run" -n 8 /bin/false 2>&1); rc=$?
  [[ $rc -eq 1 ]] || { echo "$out"; fail "attempt $attempt: 8 ranks of /bin/false ended with $rc"; break; }
  ! grep -q "Traceback" <<<"$out" || { echo "$out"; fail "attempt $attempt: gradsync-run printed a traceback"; break; }
done

# One rank fails while the others run: every one of them is stopped, and so is what they started.
marker="gradsync-run-check-$$"
out=$(timeout 60 "$run" -n 4 sh -c "if [ \$RANK = 2 ]; then exit 5; fi; sleep 300 # $marker" 2>&1); rc=$?
echo "$out"
[[ $rc -eq 5 ]] || fail "a job whose rank 2 exits with 5 ended with $rc"
sleep 0.5
! pgrep -f "$marker" >/dev/null || { pgrep -af "$marker"; fail "ranks left running after the job ended"; pkill -f "$marker"; }

# Machines emulated here: ranks numbered machine by machine, each machine with its own local ranks.
out=$(timeout 60 "$run" --machines 3 -n 2 sh -c 'echo "place $RANK $LOCAL_RANK $LOCAL_WORLD_SIZE $WORLD_SIZE"' 2>&1); rc=$?
echo "$out"
[[ $rc -eq 0 ]] || fail "3 machines of 2 ranks ended with $rc"
for r in 0 1 2 3 4 5; do
  grep -q "^\[$r\] place $r $((r % 2)) 2 6$" <<<"$out" || fail "rank $r is not local rank $((r % 2)) of 2 in a world of 6"
done

out=$(env -u RANK -u WORLD_SIZE -u OMPI_COMM_WORLD_RANK -u OMPI_COMM_WORLD_SIZE -u PMI_RANK -u PMI_SIZE \
      -u SLURM_PROCID -u SLURM_NTASKS "$probe" 2>&1); rc=$?
echo "$out"
[[ $rc -ne 0 ]] && grep -q "no launcher variables found" <<<"$out" || fail "a rank without launcher variables did not say so"

out=$(env -u GRADSYNC_TOKEN RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 "$probe" 2>&1); rc=$?
echo "$out"
[[ $rc -ne 0 ]] && grep -q "GRADSYNC_TOKEN is not set" <<<"$out" || fail "a rank without a token did not say so"

exit $status
