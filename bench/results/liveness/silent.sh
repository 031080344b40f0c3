#!/usr/bin/env bash
# How long the survivors of a 4-rank fmnist job take to fail after rank 2 goes silent: on 4 hosts,
# its link down (`ip link set v2 down`) or its process stopped (SIGSTOP); with the 4 ranks on one
# host (shared memory), its process stopped (local-stop). Usage: silent.sh link|stop|local-stop OUT_DIR
set -u
how=$1 out=$2; mkdir -p "$out"
cd /work/main
export GRADSYNC_TOKEN=$(head -c 16 /dev/urandom | xxd -p)
NC=/work/shared/tools/netcluster
log=$out/$how.log
: > "$log"
stamp() { while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done; }
if [ "$how" = local-stop ]; then launch="env RANKS_PER_HOST=4 $NC run 1"; else launch="$NC run 4"; fi
( $launch ./build-release/examples/fmnist --epochs 20 2>&1 | stamp >> "$log" ) &
job=$!
sleep 8
if [ "$how" = link ]; then
  t0=$(date +%s.%N); ip link set v2 down
else
  pid=$(for p in $(pgrep -f "build-release/examples/fmnist"); do tr '\0' '\n' < /proc/$p/environ 2>/dev/null | grep -qx RANK=2 && echo $p; done | head -1)
  t0=$(date +%s.%N); kill -STOP "$pid"
fi
echo "$t0 == host 2 silent ($how)" >> "$log"
for i in $(seq 1 60); do
  n=$(grep -cE "^\S+ \[[013]\] fmnist: gradsync:" "$log")
  [ "$n" -ge 3 ] && break
  sleep 1
done
[ "$how" = link ] && ip link set v2 up
[ "$how" != link ] && kill -KILL "$pid" 2>/dev/null
wait $job
python3 - "$log" "$t0" <<'PY'
import re, sys
log, t0 = sys.argv[1], float(sys.argv[2])
for line in open(log):
    m = re.match(r"(\S+) \[(\d)\] fmnist: (gradsync: .*)", line)
    if m and m.group(2) != '2':
        print(f"rank {m.group(2)}: {float(m.group(1)) - t0:.2f} s after: {m.group(3)[:160]}")
PY
