#!/usr/bin/env bash
# The GPU checks of hybrid emulation (issue 6), prepared on a machine without a GPU and run in
# one go on one with a GPU, where there may be no Rust toolchain and no network.
#
#   gpu-check.sh prepare [CUDA]   here: builds orrery and the GPU test with the CUDA backend
#                                 for the device's toolkit (CUDA as cudarc spells it, default
#                                 13000 for CUDA 13.0; the build cannot ask a missing nvcc),
#                                 strips them and packs them with this script's configurations
#                                 into .device/ (ignored by git, about 21 MB).
#   gpu-check.sh run              there, from the repository's root: every check below, each
#                                 with its own time limit (535 s together, so the whole run
#                                 fits a 9-minute call even if every check hangs), its output
#                                 in $OUT (default /tmp/gpu-check), a line per check in
#                                 $OUT/summary.txt.
#
# The checks, most important first, at most 8 output files:
#   fid_cpu      orrery bench --emulate-fidelity, threads on the CPU: with a core per rank
#                (the GPU machine has 16), the four-rank comparison two cores cannot make;
#   gpu_test     crates/orrery-emulate/tests/gpu.rs, ignored without a GPU: a two-rank world
#                collected on the GPU, a pool sample on every segment, an emulation's peak;
#   collect_gpu  orrery collect on gpu-memory.toml while nvidia-smi samples the device's
#                memory every 50 ms (smi.csv), to set the pool's figures against the device's;
#   emulate_gpu  orrery emulate --train of rank 0 from that collection;
#   train_gpu    orrery train on the GPU (the built-in run's model, 40 steps);
#   fid_cuda     orrery bench --emulate-fidelity --device cuda: every rank on the one GPU.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
pack="$root/.device"

prepare() {
    local cuda="${1:-13000}"
    cd "$root"
    export CUDARC_CUDA_VERSION="$cuda"
    cargo build --release -p orrery-cli --features cuda || exit 1
    local test_bin
    test_bin="$(cargo test --release -p orrery-emulate --features cuda --test gpu --no-run \
        --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])')" || exit 1
    mkdir -p "$pack"
    strip -o "$pack/orrery" target/release/orrery && gzip -9f "$pack/orrery"
    strip -o "$pack/gpu-test" "$test_bin" && gzip -9f "$pack/gpu-test"
    cp "$root/crates/orrery-emulate/scripts/gpu-memory.toml" "$pack/"
    printf 'device = "cuda"\nsteps = 40\neval_every = 20\n' > "$pack/gpu-train.toml"
    ls -la "$pack"
}

run() {
    cd "$root"
    local out="${OUT:-/tmp/gpu-check}" bin=/tmp/gpu-check-bin
    mkdir -p "$out" "$bin"
    gunzip -c "$pack/orrery.gz" > "$bin/orrery" && gunzip -c "$pack/gpu-test.gz" > "$bin/gpu-test" \
        && chmod +x "$bin/orrery" "$bin/gpu-test" || exit 1
    local summary="$out/summary.txt" o="$bin/orrery"
    for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
        [ -d "$d" ] && export LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"
    done
    {
        date; nproc
        nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
        ldconfig -p | grep -E 'libcuda\.so|nvrtc'
    } > "$summary" 2>&1
    check() {
        local name=$1 limit=$2
        shift 2
        local start
        start=$(date +%s%N)
        timeout "$limit" "$@" > "$out/$name.out" 2>&1
        echo "== $name rc=$? ms=$((($(date +%s%N) - start) / 1000000)): $*" >> "$summary"
    }
    check fid_cpu 120 "$o" bench --emulate-fidelity --runs "${RUNS_CPU:-15}"
    check gpu_test 120 "$bin/gpu-test" --ignored --nocapture
    nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 50 \
        > "$out/smi.csv" 2>&1 &
    local smi=$!
    echo "nvidia-smi sampling from $(date +%T.%N)" >> "$summary"
    check collect_gpu 90 "$o" collect "$pack/gpu-memory.toml" --ranks 2 --out /tmp/gpu.collection --json
    echo "collect_gpu ended $(date +%T.%N)" >> "$summary"
    check emulate_gpu 60 "$o" emulate --train "$pack/gpu-memory.toml" --ranks 2 \
        --graph /tmp/gpu.collection --real-ranks 0 --json
    echo "emulate_gpu ended $(date +%T.%N)" >> "$summary"
    kill "$smi"
    check train_gpu 45 "$o" train "$pack/gpu-train.toml" --out /tmp/gpu-train --json
    check fid_cuda 100 "$o" bench --emulate-fidelity --runs "${RUNS_GPU:-5}" --device cuda
    cat "$summary"
}

case "${1:-}" in
    prepare) shift; prepare "$@" ;;
    run) run ;;
    *) echo "usage: $0 prepare [CUDA] | run" >&2; exit 2 ;;
esac
