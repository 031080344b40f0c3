#!/usr/bin/env bash
# A command-line program (examples/, bench/) refuses malformed and out-of-range option values with
# a failing status and a message that names the option; it accepts what it always took, and the
# JSON it writes stays valid (odd strings included).
#   check.sh PROGRAM TRACES_DIR     (the cases are chosen by the program's name)
set -uo pipefail
program=$1 traces=$2
name=$(basename "$program")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# refuses OPTION ARG...: running the program with ARG... fails, and its message names OPTION.
refuses() {
  local option=$1 message status
  shift
  message=$(timeout 60 "$program" "$@" 2>&1 >/dev/null)
  status=$?
  if ((status == 0)); then
    fail "$name $* was accepted"
  elif [[ $message != "$name: "*"$option"* ]]; then
    fail "$name $* (status $status): the message does not name $option: $message"
  else
    echo "refused: $name $* -> $message"
  fi
}

# succeeds ARG...: running the program with ARG... succeeds.
succeeds() {
  local output
  if ! output=$(timeout 120 "$program" "$@" 2>&1); then
    fail "$name $* failed: $output"
  else
    echo "accepted: $name $*"
  fi
}

# valid_json FILE PYTHON: FILE parses as JSON, and PYTHON (an expression of `d`, the parsed value) holds.
valid_json() {
  if python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); sys.exit(0 if eval(sys.argv[2]) else 1)' "$1" "$2"; then
    echo "valid JSON: $2"
  else
    fail "$1 is not valid JSON or does not satisfy $2: $(cat "$1")"
  fi
}

# Every program answers --help with its options.
if help=$("$program" --help) && [[ $help == *--json* || $help == *--ranks* ]]; then
  echo "--help: ok"
else
  fail "$name --help: $help"
fi
required=()  # the options a program cannot run without
[[ $name == replay ]] && required=(--trace "$traces/resnet50.trace")
refuses --frobnicate "${required[@]}" --frobnicate

case $name in
  quickstart)
    refuses --ranks --ranks 4x
    refuses --ranks --ranks 0
    refuses --steps --steps ""
    refuses --steps --steps -1
    refuses --codec --codec zip
    refuses --bucketing --bucketing tree
    succeeds --ranks 3 --ranks 2 --steps 2 --codec ef-two-bit --bucketing per-tensor  # the last --ranks counts
    ;;
  fmnist)
    refuses --epochs --epochs 4x
    refuses --epochs --epochs 0
    refuses --batch --batch ""
    refuses --batch --batch -1
    refuses --lr --lr nan
    refuses --lr --lr 0
    refuses --momentum --momentum 1
    refuses --threshold --threshold -0.1
    refuses --keep --keep nan
    refuses --keep --keep 1.5
    refuses --hidden --hidden 256,x
    refuses --hidden --hidden 256,0
    refuses --steps --steps 1e3
    refuses --seed --seed -1
    refuses --topology --topology tree
    refuses --servers --servers 2
    refuses --dedicated --dedicated
    refuses --staleness --staleness -1
    refuses --quorum --quorum x
    refuses --staleness --staleness 2                                        # the asynchronous mode is a parameter server's
    refuses --staleness --topology parameter-server --servers 1 --period 5    # with co-located servers
    refuses --slow-factor --slow-factor 0.5
    refuses --executor --executor parallel
    refuses --device --device tpu
    refuses --device --device cuda --topology parameter-server                 # the device path is the ring's
    refuses --ipc --ipc                                                         # --ipc and --nccl go with --device cuda
    refuses --nccl --nccl
    message=$("$program" --data "$work/no-data" --topology parameter-server --staleness 2 --quorum 1 --period 10 \
      --slow-rank 1 --slow-factor 2 2>&1)
    if [[ $message == *"$work/no-data"* ]]; then echo "accepted: asynchronous options"; else fail "fmnist: $message"; fi
    # Accepted options get as far as reading the data (absent here).
    message=$("$program" --data "$work/no-data" --hidden 64,32 --codec ef-top-k --keep 0.1 --lr 0.05 --momentum 0.9 \
      --topology parameter-server --servers 1 --seed 7 2>&1)
    if [[ $message == *"$work/no-data"* ]]; then echo "accepted: got as far as the data"; else fail "fmnist: $message"; fi
    ;;
  libtorch-fmnist)
    refuses --epochs --epochs 0
    refuses --batch --batch -1
    refuses --lr --lr nan
    refuses --momentum --momentum 1
    refuses --threshold --threshold -0.1
    refuses --steps --steps 1e3
    refuses --threads --threads 0
    refuses --topology --topology tree
    refuses --bucketing --bucketing fixed-size   # one bucketing only: not an option
    # Accepted options get as far as reading the data (absent here).
    message=$("$program" --data "$work/no-data" --codec ef-two-bit --threshold 0.02 --topology parameter-server \
      --threads 1 --seed 3 2>&1)
    if [[ $message == *"$work/no-data"* ]]; then echo "accepted: got as far as the data"; else fail "libtorch-fmnist: $message"; fi
    ;;
  ctr)
    refuses --table --table elsewhere
    refuses --epochs --epochs 0
    refuses --batch --batch -1
    refuses --lr --lr nan
    refuses --sparse-lr --sparse-lr 0
    refuses --optimizer --optimizer adam
    refuses --dim --dim 0
    refuses --rows --rows 1e6
    refuses --hidden --hidden 64,0
    refuses --averaging --averaging mean
    refuses --min-class --min-class 0
    refuses --steps --steps -1
    refuses --seed --seed x
    message=$("$program" --data "$work/no-index" 2>&1)
    if [[ $message == *"$work/no-index"* ]]; then echo "accepted: got as far as the data"; else fail "ctr: $message"; fi
    # A small index of its own: two sections, the words telling them apart.
    for i in $(seq 1 60); do
      printf 'Package: p%d\nSection: %s\nPriority: optional\nDescription: word%d\n\n' "$i" \
        "$( ((i % 2)) && echo games || echo contrib/utils)" $((i % 2))
    done >"$work/index"
    refuses --rows --data "$work/index" --min-class 1 --rows 2
    succeeds --data "$work/index" --min-class 1 --rows 64 --batch 4 --epochs 2 --dim 4 --hidden 8 --optimizer sgd \
      --averaging world-size --json "$work/ctr.json"
    valid_json "$work/ctr.json" 'd["classes"] == ["games", "utils"] and len(d["epochs"]) == 2 and d["machine_trainers"] == 1 and d["machine_pss_bytes"] > 0 and d["table_bytes"] > 0'
    ;;
  hybrid)
    refuses --mode --mode pipeline
    refuses --updates --updates never
    refuses --epochs --epochs 0
    refuses --batch --batch -1
    refuses --lr --lr nan
    refuses --momentum --momentum 1
    refuses --channels --channels 8,0
    refuses --hidden --hidden x
    refuses --steps --steps -1
    refuses --seed --seed x
    # Accepted options get as far as reading the data (absent here).
    message=$("$program" --data "$work/no-data" --mode data-parallel --updates after-wait --channels 4 --hidden 32 \
      --batch 32 --lr 0.1 2>&1)
    if [[ $message == *"$work/no-data"* ]]; then echo "accepted: got as far as the data"; else fail "hybrid: $message"; fi
    ;;
  allreduce)
    refuses --ranks --ranks 4x
    refuses --ranks --ranks 0
    refuses --min-bytes --min-bytes 4x
    refuses --min-bytes --min-bytes 2
    refuses --max-bytes --max-bytes 1T
    refuses --max-bytes --max-bytes 99999999999G
    refuses --step-factor --step-factor 1
    refuses --iters --iters 0
    refuses --warmup --warmup ""
    refuses --keep --keep nan
    refuses --threshold --threshold 0
    refuses --chunk-bytes --chunk-bytes -1
    refuses --partitions --partitions 1.5
    refuses --transport --transport udp
    refuses --min-bytes --min-bytes 8K --max-bytes 4K
    refuses --data --data zeros
    succeeds --ranks 2 --min-bytes 1K --max-bytes 4KiB --iters 1 --warmup 1 --chunk-bytes 1K --codec ef-two-bit \
      --json "$work/allreduce.json"
    valid_json "$work/allreduce.json" '[r["bytes"] for r in d] == [1024, 4096] and d[0]["codec"] == "ef-two-bit" and all(r["data"] == "gradient" and r["wrong"] == 0 for r in d)'
    succeeds --ranks 3 --min-bytes 1K --max-bytes 1K --iters 1 --warmup 1 --codec top-k --data constant \
      --json "$work/allreduce-constant.json"
    valid_json "$work/allreduce-constant.json" 'd[0]["data"] == "constant" and d[0]["wrong"] is None'
    ;;
  codecs)
    refuses --min-mib --min-mib 4x
    refuses --min-mib --min-mib 0
    refuses --max-mib --max-mib -1
    refuses --max-mib --max-mib 99999999999999999
    refuses --step-factor --step-factor 1
    refuses --iters --iters 0
    refuses --codec --codec zip
    refuses --min-mib --min-mib 2 --max-mib 1
    succeeds --min-mib 1 --max-mib 1 --iters 1 --codec fp16 top-k --json "$work/codecs.json"
    valid_json "$work/codecs.json" '[r["codec"] for r in d] == ["fp16", "top-k"] and d[0]["bytes"] == 1 << 20'
    ;;
  setup)
    refuses --rounds --rounds 0
    refuses --rounds --rounds x
    succeeds --rounds 2 --json "$work/setup.json"  # a world of one: nothing to connect
    valid_json "$work/setup.json" 'd["ranks"] == 1 and len(d["rank0_ms"]) == 2'
    ;;
  soak)
    refuses --iters --iters 0
    refuses --sample-every --sample-every x
    succeeds --iters 3 --sample-every 2 --json "$work/soak.json"
    valid_json "$work/soak.json" 'len(d["configurations"]) == 4 and d["rank0_rss_mb"][0][0] == 0 and d["ranks"] == 1'
    ;;
  timeline)
    refuses --threads --threads 0
    refuses --events --events 4x
    succeeds --events 1000 --threads 2 --repeats 2 --json "$work/timeline.json"
    valid_json "$work/timeline.json" 'd["threads"] == 2 and d["record_ns_per_event"] > 0 and d["write_ns_per_event"] > 0'
    ;;
  sparse)
    refuses --keys --keys 0
    refuses --key-space --key-space x
    refuses --dim --dim 0
    refuses --iters --iters 0
    refuses --modes --modes sparse,zip
    succeeds --keys 64 --key-space 4096 --dim 4 --iters 2 --warmup 1 --modes sparse,dense,table --json "$work/sparse.json"
    valid_json "$work/sparse.json" '[r["mode"] for r in d] == ["sparse", "dense", "table"] and d[0]["ranks"] == 1 and d[0]["time_ms"] > 0'
    ;;
  replay)
    trace=$traces/resnet50.trace
    refuses --iters --trace "$trace" --iters 4x
    refuses --iters --trace "$trace" --iters 0
    refuses --warmup --trace "$trace" --warmup -1
    refuses --data --trace "$trace" --data random
    refuses --cap-mib --trace "$trace" --cap-mib x
    refuses --cap-mib --trace "$trace" --cap-mib 0
    refuses --min-bucket-kib --trace "$trace" --min-bucket-kib -1
    refuses --size-scale --trace "$trace" --size-scale 0
    refuses --time-scale --trace "$trace" --time-scale -1
    refuses --jitter --trace "$trace" --jitter 1
    refuses --jitter --trace "$trace" --jitter nan
    refuses --drift-at --trace "$trace" --drift-at -2
    refuses --drift-factor --trace "$trace" --drift-factor 0
    refuses --chunk-mib --trace "$trace" --chunk-mib nan
    refuses --partitions --trace "$trace" --partitions -1
    refuses --compute-threads --trace "$trace" --compute-threads 0
    refuses --spin-before-sleep --trace "$trace" --spin-before-sleep -1
    refuses --spin-before-sleep --trace "$trace" --spin-before-sleep 10001
    refuses --window --trace "$trace" --window 0
    refuses --batch-kib --trace "$trace" --batch-kib 4x
    refuses --batch-kib --trace "$trace" --batch-kib 0
    refuses --keep --trace "$trace" --keep 2
    refuses --executor --trace "$trace" --executor eager
    refuses --servers --trace "$trace" --servers 1
    refuses --trace --iters 1
    refuses --trace --trace "$work/missing.trace"
    # A trace whose name needs escaping in JSON.
    odd=$work/'odd "name" \ tab	.trace'
    cp "$trace" "$odd"
    succeeds --trace "$odd" --iters 1 --warmup 1 --time-scale 0 --size-scale 0.01 --bucketing fixed-size --cap-mib 0.5 \
      --spin-before-sleep 20 --json "$work/replay.json"
    valid_json "$work/replay.json" \
      'd["trace"].endswith("odd \"name\" \\ tab\t.trace") and len(d["samples"]) == 1 and d["spin_before_sleep_us"] == 20'
    ;;
  scale_model)
    results=$traces/../results
    refuses --bandwidth --bandwidth 25
    refuses --bandwidth --bandwidth 25Gb/s
    refuses --intra-bandwidth --intra-bandwidth x
    refuses --latency-us --latency-us -1
    refuses --ranks --ranks 1024,0
    refuses --ranks --ranks 1020 --ranks-per-machine 8
    refuses --ranks-per-machine --ranks-per-machine 0
    refuses --sizes --sizes 4K,2
    refuses --cap-mib --cap-mib 0
    refuses --codec --codec zip
    refuses --codec-results --codec-results "$work/missing.json" --trace "$traces/resnet50.trace"
    refuses --trace --codec-results "$results/codecs-cpu.json" --trace "$work/missing.trace"
    refuses --validate --validate "$work/missing.json"
    succeeds --ranks 16,64 --sizes 4K,1M --codec-results "$results/codecs-cpu.json" --trace "$traces/resnet50.trace" \
      --json "$work/model.json"
    valid_json "$work/model.json" '[r["ranks"] for r in d["setup"]] == [16, 64] and len(d["allreduce"]) == 24 and len(d["replay"]) == 12 and d["replay"][0]["iteration_ms"] >= d["replay"][0]["backward_ms"]'
    # A run's rows, the auto one with the link it measured, and a setup.
    mkdir -p "$work/run"
    printf '%s\n' '[{"bytes":4096,"ranks":8,"topology":"auto","schedule":"recursive-doubling","codec":"none","transport":"tcp","executor":"serial","time_us":300,"link_latency_us":100,"link_GBps":1}]' >"$work/run/auto.json"
    printf '%s\n' '[{"bytes":4096,"ranks":8,"topology":"ring","schedule":"ring","codec":"none","transport":"tcp","executor":"serial","time_us":1400},' \
      '{"bytes":1048576,"ranks":8,"topology":"ring","schedule":"ring","codec":"none","transport":"tcp","executor":"serial","time_us":2000}]' >"$work/run/ring.json"
    mkdir -p "$work/setup"
    printf '%s\n' '{"ranks":8,"rounds":1,"median_rank0_ms":2,"median_slowest_ms":2.5}' >"$work/setup/gradsync-setup-8.json"
    succeeds --validate "$work/run/auto.json" "$work/run/ring.json" "$work/setup/gradsync-setup-8.json" --latency-us 50 \
      --json "$work/validation.json"
    valid_json "$work/validation.json" 'len(d["validation"]) == 4 and d["validation"][1]["link_from"] == "the session'"'"'s auto.json" and abs(d["validation"][0]["predicted_ms"] - 0.312) < 0.001 and "fitted_link" in d["validation"][0] and d["validation"][3]["link_from"] == "the command line"'
    ;;
  *)
    fail "no cases for $name"
    ;;
esac
echo "$failures failure(s)"
((failures == 0))
