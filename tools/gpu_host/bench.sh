#!/usr/bin/env bash
# One script for a GPU host: install the wheels it lacks (from .whl/), make the full-size random VoxCPM2
# checkpoint, run tools/gpu_check.py, benchmark voxcpm-serve and nano-vllm-voxcpm with
# `tools/bench.py stream` under one protocol, and print the ratio table (`tools/bench.py compare`).
#
# On a machine with network, once:   bash tools/gpu_host/fetch_wheels.sh      (fills .whl/, ~5 MiB)
# On the GPU host:                   bash tools/gpu_host/bench.sh, with .whl/ copied beside the tree
#
# The time a GPU host is lent for may be short, so pick the parts of each run with PARTS (default "check ours nano"):
#   PARTS="test check" bash tools/gpu_host/bench.sh      # the CUDA tests (mostly JIT, in TEST_PROCS processes), gpu_check
#   PARTS="profile" BASELINE=old bash tools/gpu_host/bench.sh   # step profile, of the tree in old/ too
#   PARTS="ours nano" bash tools/gpu_host/bench.sh       # both benchmarks + comparison
#   PARTS="nano" CONC=1,8 bash tools/gpu_host/bench.sh   # one peer, fewer concurrencies
#   PARTS="" OUT=dir-with-both-jsons bash tools/gpu_host/bench.sh   # only the comparison
#   PARTS="ours http encode" CONC=1,8,32,64,128 bash tools/gpu_host/bench.sh   # the pool, then the service over HTTP
#   PARTS="http_base" BASELINE=old ...   # the service of an earlier tree (old/) at HTTP_BASE_CONC, with a profile
#   PARTS="ours ours_base cold" BASELINE=old CONC=1,8,128 ...   # this tree against an earlier one: the pool, cold starts
#   PARTS="cold" BASELINE=old COLD_ROUNDS=3 COLD_PYSPY=1 ...   # cold starts, then one more under py-spy (pyspy_start_*)
#   PARTS="manifest_check" CKPT=/tmp/half PRESET=full-voxcpm0.5b   # the shipped manifests cover that model's kernels
#   PARTS="manifest cold" COLD_VARIANTS="-;VOXCPM_PRECOMPILE=0" ...   # re-record the kernel manifest, then starts
#   PARTS="cold" COLD_PREBUILT=/tmp/kernels COLD_VARIANTS="-;NANOVLLM_PREBUILT_KERNELS_DIR=/tmp/kernels"   # the image's
#       kernels built first (python -m engine.startup.prebuild; COLD_PREBUILT_ARGS=--link-stub links as an image build does),
#       then starts on an empty cache without them and seeded with them
#   PARTS="cold" COLD_DROP_CACHES=1 ...   # each start after dropping the page cache (root): checkpoint and libraries cold
#   PARTS="gpu2" GPU2_ENV="NANOVLLM_API_PROCESSES=28" ...   # one GPU against two, the services in that environment
#   PARTS="lora" CONC=1,64 LORAS=4 LORA_RANK=32 ...   # runtime LoRA adapters vs the base model vs a merged adapter
#   PARTS="ours_base ours" BASELINE=old CONC=1,128,256 BENCH_ARGS="--max-num-seqs 256" FRESH_KERNELS=1 \
#       OURS_VARIANTS='-;{"quantization":"fp8"};{"quantization":"fp8","vae_dtype":"bfloat16"}'   # the options' table
#   PARTS="fp8acc" FP8ACC_VARIANTS="-;VOXCPM_FP8_FAST_ACCUM=1"   # FP8 accuracy, batched and one request at a time
#   PARTS="rounds" BASELINE=old ROUNDS=3 CONC=256 ITERS=3 BENCH_ARGS="--max-num-seqs 256"   # old/ and this tree
#       alternating, round by round (rounds_base_N.json, rounds_tree_N.json); ROUND_ENV="VOXCPM_X=0" instead of
#       BASELINE: this tree in that environment and as it is (rounds_env_N.json, rounds_tree_N.json)
#   PARTS="burst" BASELINE=old BURST_VARIANTS="--max-num-batched-tokens 8192;--pool-kwargs {\"running_prefill_tokens\":2048}"
#       a burst of BURST (128) onto RUNNING (128) streams (`tools/bench.py arrival-burst`), once per variant (extra
#       flags), BASELINE's engine first (its variants: BURST_BASE_VARIANTS); files burst_*.json
#   PARTS="http_env" BASELINE=old HTTP_ROUNDS=3 HTTP_VARIANTS="-;NANOVLLM_WORKER_CPUS=1" CONC=64,128 ...   # rounds
#       of the old service and this tree's in each environment, alternating, MP3 at CONC (HTTP_ENV_FORMATS="pcm mp3":
#       both; `tools/bench.py serving-report`)
# Rough times: wheels ~10 s; checkpoint 1-3 min (skipped when $CKPT was finished by an earlier run on a
# host not yet handed back); nano at 1,8,32,64 ~2.5 min (startup 40-55 s, then 12 bursts of 16 s of audio at
# 10-125 audio-s/s); ours the same if it matches nano, ~5 min at the eager 164-197 ms/step. Every part
# runs under its own limit, capped by what is left of BUDGET_S, and the benchmark JSON is rewritten after
# each concurrency, so a part cut off still returns its finished rows. $OUT is emptied before each
# run: when ours and nano run separately, compare the two fetched files here with
# `python tools/bench.py compare ours.json nano.json`. The comparison runs at the end of a run whenever
# $OUT holds both.
#
# Knobs (environment): HTTP_ARGS (extra `tools/bench.py http` flags for every sweep, e.g. "--client raw"), HTTP_PYSPY
# (empty: no py-spy profile during the MP3 sweep's last level, which costs the host CPU), PARTS, CONC (1,8,32,64), ITERS (2), PATCHES (100), MODE (zeroshot|hifi),
# PRESET (full-voxcpm2), CKPT (/tmp/full), BUDGET_S (total seconds this run may use, 580), T_CHECK / T_OURS / T_NANO (per-part
# time limits, seconds; T_TEST for the CUDA tests, TEST_PROCS (6) processes for their kernel cases), BENCH_ARGS (extra flags for both benchmarks), OURS_ARGS / NANO_ARGS (per engine),
# CHECK_ARGS (extra flags for gpu_check.py), PROFILE_BATCH (1,8,64), PROFILE_ARGS (e.g. "--burst-patches 100"), BASELINE, T_PROFILE, FRESH_KERNELS (1: our
# benchmark starts on an empty Triton kernel cache, for the cold start of a fresh GPU host). Files in $OUT:
# bench.log, gpu_check.json, profile.json, profile_before.json, ours.json, nano.json, compare.md.
# The service parts (http, http_base) start `python3 -m service.main` on the checkpoint with the pool benchmark's
# engine settings (max_num_seqs = the largest CONC, max_model_len 1024, 0.85 of the GPU memory) on an empty
# cache dir (its start to /ready is the cold start), then run `tools/bench.py http` (8 client processes) for each of
# HTTP_RUNS (mp3 pcm speech hifi; hifi at HIFI_CONC; also long short: a LONG_CHARS text in segments of LONG_PATCHES), py-spy recording every service process during the largest
# concurrency of the first run. Their files: http_*.json, pyspy_*.txt, service_*.log, encode.json, metrics_after_*.txt
# (the service's encoder and TTFB metrics after each run, cumulative); past 7 files
# in $OUT everything but the log is packed into results.tgz (fewer files to copy back from the GPU host).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/gpu_host_bench}"
mkdir -p "$OUT"
LOG="$OUT/bench.log"

PARTS="${PARTS-check ours nano}"   # empty: only the comparison of JSONs already in $OUT
CONC="${CONC:-1,8,32,64}"
ITERS="${ITERS:-2}"
MODE="${MODE:-zeroshot}"
PATCHES="${PATCHES:-}"
PRESET="${PRESET:-full-voxcpm2}"   # full-voxcpm0.5b for the VoxCPM-0.5B-size table (use another CKPT)
CKPT="${CKPT:-/tmp/full}"
BUDGET_S="${BUDGET_S:-580}"
T_CHECK="${T_CHECK:-240}"
T_TEST="${T_TEST:-420}"
T_OURS="${T_OURS:-330}"
T_NANO="${T_NANO:-240}"
T_PROFILE="${T_PROFILE:-150}"
PROFILE_BATCH="${PROFILE_BATCH:-1,8,64}"
HTTP_RUNS="${HTTP_RUNS:-mp3 pcm speech hifi}"
HIFI_CONC="${HIFI_CONC:-1,5,10}"
HTTP_BASE_CONC="${HTTP_BASE_CONC:-128}"
T_HTTP="${T_HTTP:-420}"
PORT="${PORT:-8123}"
SITE=/tmp/site
SHIM="$ROOT/.whl/flash_attn_shim"

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TQDM_MININTERVAL=5   # fewer progress-bar redraws in the log
START=$SECONDS

log() { echo "[gpu_host/bench +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET_S - (SECONDS - START))); }

# Run "$@" under a time limit (seconds, $1) capped by what is left of BUDGET_S; output to the log.
# timeout puts the command in its own process group and kills the whole group, so the engines'
# spawned worker processes go with it and free the GPU for the next part.
run_limited() {
    local want=$1 name=$2
    shift 2
    local cap=$(( $(left) - 20 ))   # keep ~20 s for the comparison and the summary
    local lim=$(( want < cap ? want : cap ))
    if (( lim < 30 )); then
        log "SKIP $name: only $(left)s of the ${BUDGET_S}s budget left"
        return 124
    fi
    log "START $name (limit ${lim}s, $(left)s of budget left): $*"
    local t0=$SECONDS
    timeout -k 15 "$lim" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    log "END $name rc=$rc in $((SECONDS - t0))s$( ((rc == 124)) && echo ' (TIMED OUT)')"
    return "$rc"
}

gpu_mem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | head -1; }

setup_wheels() {
    [[ -n "${WHEELS_DONE:-}" ]] && return 0
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        log "ERROR: no .whl/*.whl (run tools/gpu_host/fetch_wheels.sh where there is network; copy .whl/ with the tree)"
        return 1
    fi
    log "installing $(ls .whl/*.whl | wc -l) wheels to $SITE"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        .whl/*.whl 2>&1 | tee -a "$LOG" || return 1
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PATH="$SITE/bin:$PATH"  # py-spy's binary too
    WHEELS_DONE=1
    { nproc; lscpu | grep -E "^(Model name|Thread|Core|Socket|CPU\(s\)|NUMA)"; } 2>&1 | tee -a "$LOG"
    # The wheels were installed without their dependencies: check that the image satisfies them.
    python3 - <<'PY' 2>&1 | tee -a "$LOG"
import importlib.metadata as md
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

env = {**default_environment(), "extra": ""}
bad = []
for dist_info in sorted(Path("/tmp/site").glob("*.dist-info")):
    dist = md.Distribution.at(dist_info)
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        if req.name.replace("_", "-").lower() in ("flash-attn", "torchcodec"):
            continue  # shimmed / never imported
        try:
            have = md.version(req.name)
        except md.PackageNotFoundError:
            bad.append(f"{dist.metadata['Name']}: needs {req}, missing")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            bad.append(f"{dist.metadata['Name']}: needs {req}, found {have}")
print("dependency check:", "all satisfied" if not bad else "\n  " + "\n  ".join(bad))
PY
    python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, \
'cuda', torch.version.cuda)" 2>&1 | tee -a "$LOG"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>&1 | tee -a "$LOG"
    return 0   # the lines above only inform
}

setup_checkpoint() {
    # The marker (beside the folder) is written only after a finished run, so a checkpoint cut off by a time limit is not reused.
    if [[ -f "$CKPT.complete" ]]; then
        log "checkpoint $CKPT already there (from an earlier run on this host): reused"
        return 0
    fi
    rm -rf "$CKPT"
    # ~4.6 GB of random bf16 weights; the stop head never fires, so every request makes exactly N patches.
    run_limited 300 checkpoint python3 tools/make_random_checkpoint.py --preset "$PRESET" --never-stop \
        --out "$CKPT" || return 1
    touch "$CKPT.complete"
}

bench() {  # bench ENGINE JSON LIMIT [extra PYTHONPATH]
    local engine=$1 json=$2 lim=$3 extra_path=${4:-}
    local args=(--engine "$engine" --model "$CKPT" --conc "$CONC" --iters "$ITERS" --mode "$MODE" --out "$json")
    [[ -n "$PATCHES" ]] && args+=(--patches "$PATCHES")
    local more="${BENCH_ARGS:-}"
    [[ $engine == nanovllm ]] && more="$more ${NANO_ARGS:-}" || more="$more ${OURS_ARGS:-}"
    # shellcheck disable=SC2206  # word splitting of the extra flags is intended
    args+=($more)
    log "GPU memory before $engine: $(gpu_mem)"
    local cmd=(python3 tools/bench.py stream)
    [[ -f tools/bench.py ]] || cmd=(python3 tools/bench_stream.py)  # an earlier tree (ours_base) has its own script
    PYTHONPATH="${extra_path:+$extra_path:}${PYTHONPATH:-}" run_limited "$lim" "bench-$engine" "${cmd[@]}" "${args[@]}"
}

bench_ours() {  # bench_ours JSON: `bench voxcpm-serve`, with FRESH_KERNELS=1 on an empty Triton kernel cache of its own
    local json=$1 fresh rc
    [[ "${FRESH_KERNELS:-0}" == 1 ]] || { bench voxcpm-serve "$json" "$T_OURS"; return; }
    fresh="$(mktemp -d)"
    log "empty Triton kernel cache for this benchmark: $fresh"
    TRITON_CACHE_DIR="$fresh" bench voxcpm-serve "$json" "$T_OURS"
    rc=$?
    rm -rf "$fresh"
    return $rc
}

# --- the service over HTTP ----------------------------------------------------------------------------------
SVC_PID=""
start_service() {  # start_service TREE NAME: the service of code tree TREE; sets SVC_PID, logs the cold start
    local tree=$1 name=$2 maxseqs=${MAXSEQS:-${CONC##*,}}
    local cache; cache="$(mktemp -d)"
    log "starting the service of $tree (cache $cache: empty, a cold start)"
    local t0; t0=$(date +%s.%N)
    (cd "$tree" && exec env NANOVLLM_MODEL_PATH="$CKPT" NANOVLLM_CACHE_DIR="$cache" NANOVLLM_PORT="$PORT" \
        NANOVLLM_HOST=127.0.0.1 NANOVLLM_SERVERPOOL_MAX_NUM_SEQS="$maxseqs" NANOVLLM_SERVERPOOL_MAX_MODEL_LEN=1024 \
        NANOVLLM_SERVERPOOL_GPU_MEMORY_UTILIZATION=0.85 NANOVLLM_SEGMENT_CHARS=1000 ${SERVICE_ENV:-} \
        python3 -m service.main) \
        >"$OUT/service_$name.log" 2>&1 &
    SVC_PID=$!
    if [[ -n "${PYSPY_START:-}" ]] && command -v py-spy >/dev/null; then  # where the start-up's time goes
        py-spy record --pid "$SVC_PID" --subprocesses --idle --nonblocking --rate 100 --duration 30 --format raw \
            --output "$OUT/pyspy_start_$name.txt" >"$OUT/pyspy_start_$name.log" 2>&1 &
    fi
    for _ in $(seq 1 600); do
        if curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null 2>&1; then
            log "service $name ready in $(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }') s (pid $SVC_PID)"
            return 0
        fi
        kill -0 "$SVC_PID" 2>/dev/null || { log "service $name exited during start-up"; return 1; }
        sleep 0.2
    done
    log "service $name not ready after 120 s"
    return 1
}

drop_caches() {  # COLD_DROP_CACHES=1: a fresh node's start, the checkpoint and the libraries read from disk again
    [[ -n "${COLD_DROP_CACHES:-}" ]] || return 0
    sync && { echo 3 > /proc/sys/vm/drop_caches; } 2>/dev/null && log "page cache dropped" || log "page cache NOT dropped"
}

stop_service() {
    [[ -n "$SVC_PID" ]] || return 0
    kill -TERM "$SVC_PID" 2>/dev/null
    for _ in $(seq 1 60); do kill -0 "$SVC_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$SVC_PID" 2>/dev/null
    pkill -KILL -f "multiprocessing.spawn" 2>/dev/null  # anything it left (the next service needs the GPU)
    SVC_PID=""
    sleep 1
}

http_bench() {  # http_bench NAME CONC [`tools/bench.py http` flags]: one sweep; a py-spy profile of its last level
    local name=$1 conc=$2
    shift 2
    local head=${conc%,*} last=${conc##*,}
    if [[ "$head" != "$conc" ]]; then
        # shellcheck disable=SC2086  # HTTP_ARGS: extra flags for every sweep, e.g. "--client raw"
        run_limited "$T_HTTP" "http-$name" python3 tools/bench.py http "http://127.0.0.1:$PORT" --conc "$head" \
            --procs 8 --pid "$SVC_PID" --label "$name" --out "$OUT/http_${name}_a.json" ${HTTP_ARGS:-} "$@"
    fi
    local spy=""
    if [[ -n "${PYSPY:-}" ]] && command -v py-spy >/dev/null; then
        py-spy record --pid "$SVC_PID" --subprocesses --nonblocking --rate 67 --duration 12 --format raw \
            --output "$OUT/pyspy_${name}_c$last.txt" >"$OUT/pyspy_${name}.log" 2>&1 &
        spy=$!
        sleep 1
    fi
    # shellcheck disable=SC2086
    run_limited "$T_HTTP" "http-$name-c$last" python3 tools/bench.py http "http://127.0.0.1:$PORT" --conc "$last" \
        --procs 8 --pid "$SVC_PID" --label "$name" --out "$OUT/http_${name}_b.json" ${HTTP_ARGS:-} "$@"
    local rc=$?
    [[ -n "$spy" ]] && wait "$spy"
    return $rc
}

log "parts: $PARTS; conc=$CONC iters=$ITERS mode=$MODE patches=${PATCHES:-default}; budget ${BUDGET_S}s; out=$OUT"
declare -A RC
for part in $PARTS; do
    case $part in
        test)
            # The CUDA tests (kernels vs eager, graphs vs eager, paged attention); no checkpoint needed.
            setup_wheels || { RC[$part]=setup; continue; }
            # Every test that skips without CUDA (tests/conftest.py marks them `gpu`); the interpreter cases of the
            # same files are CPU CI's (minutes of this host's CPU): not here.
            # Only modules that can skip for want of CUDA are collected (tests/conftest.py marks by the skip reason): the
            # others' test-only dependencies (schemathesis, openai: CPU CI's) are not in the image.
            ignore=()
            for mod in tests/test_*.py; do
                grep -q "CUDA" "$mod" || ignore+=(--ignore "$mod")
            done
            # The kernel-vs-eager cases are compile-bound (the VAE's cases compile tens of variants each, ~100 s a
            # dtype): TEST_PROCS processes run them beside the others. The others run in one process (-o addopts: not
            # pyproject's two xdist processes): they size KV caches from the GPU's free memory, so no two engines may
            # share the GPU (the kernel cases hold little memory).
            kernel_cases="test_cuda_matches_eager"
            run_limited "$T_TEST" pytest_kernels python3 -m pytest -p no:cacheprovider -o addopts=-ra -q -m gpu \
                -n "${TEST_PROCS:-6}" -k "$kernel_cases${TEST_K:+ and ($TEST_K)}" tests/test_ops_kernels.py &
            kernels_pid=$!
            run_limited "$T_TEST" pytest python3 -m pytest -p no:cacheprovider -o addopts=-ra -q -m gpu "${ignore[@]}" \
                -k "not $kernel_cases${TEST_K:+ and ($TEST_K)}" tests/
            RC[$part]=$?
            wait "$kernels_pid" || RC[$part]=$?
            ;;
        check)
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            # A failure here must not stop the benchmarks.
            # shellcheck disable=SC2086
            run_limited "$T_CHECK" gpu_check python3 tools/gpu_check.py --full "$CKPT" --out "$OUT/gpu_check.json" \
                ${CHECK_ARGS:-}
            RC[$part]=$?
            ;;
        ours)  # once per OURS_VARIANTS entry (pool kwargs JSON, "-": none) into ours.json, ours_2.json, ...
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            RC[$part]=0
            IFS=';' read -ra list <<<"${OURS_VARIANTS:--}"
            i=0
            for v in "${list[@]}"; do
                i=$((i + 1))
                json="$OUT/ours.json"; [[ $i -gt 1 ]] && json="$OUT/ours_$i.json"
                extra=""; [[ "$v" != - ]] && extra="--pool-kwargs $v"
                OURS_ARGS="${OURS_ARGS:-} $extra" bench_ours "$json" || RC[$part]=$?
            done
            ;;
        fp8acc)  # FP8 accuracy on a checkpoint whose stop head fires ($CKPT-stop), per FP8ACC_VARIANTS entry
            # (environment assignments, "-": none), all requests together and one at a time; files fp8acc_*.json
            setup_wheels || { RC[$part]=setup; continue; }
            stop_ckpt="$CKPT-stop"
            [[ -f "$stop_ckpt/config.json" ]] || run_limited 300 checkpoint-stop python3 tools/make_random_checkpoint.py \
                --preset "$PRESET" --out "$stop_ckpt" || { RC[$part]=setup; continue; }
            RC[$part]=0
            IFS=';' read -ra list <<<"${FP8ACC_VARIANTS:--}"
            i=0
            for v in "${list[@]}"; do
                i=$((i + 1))
                [[ "$v" == - ]] && v=""
                for seqs in 64 1; do
                    # shellcheck disable=SC2086  # the variant's assignments split into words
                    run_limited "${T_FP8ACC:-150}" "fp8acc-$i-$seqs" env $v python3 tools/bench.py fp8-accuracy \
                        --model "$stop_ckpt" --requests 64 --patches 20 --min-len 8 --max-num-seqs "$seqs" \
                        --out "$OUT/fp8acc_${i}_seqs$seqs.json" || RC[$part]=$?
                done
            done
            ;;
        ours_window)  # the pool with the service's coalescing window (the same engine settings as the service); the
            # window's --pool-kwargs comes after BENCH_ARGS', and bench.py merges the two (FP8 stays FP8)
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            OURS_ARGS="${OURS_ARGS:-} --pool-kwargs {\"coalesce_ms\":5}" bench voxcpm-serve "$OUT/pool_window.json" "$T_OURS"
            RC[$part]=$?
            ;;
        ours_hifi)  # the pool in HiFi mode (a 5 s clip as prompt and reference, 40 patches) at HIFI_CONC, with the
            # service's coalescing window
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            CONC="$HIFI_CONC" MODE=hifi PATCHES=40 OURS_ARGS="${OURS_ARGS:-} --pool-kwargs {\"coalesce_ms\":5}" \
                bench voxcpm-serve "$OUT/pool_hifi.json" "$T_OURS"
            RC[$part]=$?
            ;;
        nano)
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            [[ -d "$SHIM/flash_attn" ]] || log "WARNING: no $SHIM/flash_attn: nano-vllm-voxcpm will not import"
            bench nanovllm "$OUT/nano.json" "$T_NANO" "$SHIM"
            RC[$part]=$?
            ;;
        profile)
            # Per-component profile of a step (`tools/profiler.py step`) at PROFILE_BATCH; with BASELINE=dir (a
            # copy of an earlier tree, e.g. `git archive <commit> engine tools | tar -x -C dir`) the same
            # profiler also runs that tree's engine first, for a before/after on one host.
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            RC[$part]=0
            if [[ -n "${BASELINE:-}" ]]; then
                # today's profiler (and the harness and check it imports), old engine
                cp -r tools/profiler.py tools/subcommands.py tools/gpu_check.py tools/profiling tools/benchmarks \
                    "$BASELINE/tools/"
                # shellcheck disable=SC2086  # PROFILE_ARGS: extra flags, one word each
                run_limited "$T_PROFILE" profile-baseline python3 "$BASELINE/tools/profiler.py" step --model "$CKPT" \
                    --batch "$PROFILE_BATCH" --kernels ${PROFILE_ARGS:-} --out "$OUT/profile_before.json" || RC[$part]=$?
            fi
            # shellcheck disable=SC2086
            run_limited "$T_PROFILE" profile python3 tools/profiler.py step --model "$CKPT" --batch "$PROFILE_BATCH" \
                --kernels ${PROFILE_ARGS:-} --out "$OUT/profile.json" || RC[$part]=$?
            ;;
        encode)
            setup_wheels || { RC[$part]=setup; continue; }
            # shellcheck disable=SC2086  # ENCODE_ARGS: extra flags, e.g. "--threads 1,14,28,56"
            run_limited 120 encode python3 tools/bench.py encode --out "$OUT/encode.json" ${ENCODE_ARGS:-}
            RC[$part]=$?
            ;;
        http)
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            start_service "$ROOT" new || { stop_service; RC[$part]=start; continue; }
            RC[$part]=0
            for run in $HTTP_RUNS; do
                case $run in
                    mp3) PYSPY=${HTTP_PYSPY-1} http_bench mp3 "$CONC" --format mp3 ;;
                    pcm) http_bench pcm "$CONC" --format pcm ;;
                    speech) http_bench speech "$CONC" --route speech --format mp3 ;;
                    hifi) http_bench hifi "$HIFI_CONC" --voice hifi --format mp3 --patches 40 ;;
                    # a long text (LONG_CHARS, spoken as segments of LONG_PATCHES patches) and the one-segment
                    # request of the same patches, PCM: the long one's first audio against the short one's
                    long) http_bench long "$CONC" --format pcm --text-chars "${LONG_CHARS:-20000}" \
                              --patches "${LONG_PATCHES:-10}" ;;
                    short) http_bench short "$CONC" --format pcm --patches "${LONG_PATCHES:-10}" ;;
                    # CONC live-text sessions over the WebSocket, a word every WS_WORD_MS
                    ws) run_limited "$T_HTTP" ws python3 tools/bench.py ws "http://127.0.0.1:$PORT" --conc "$CONC" \
                            --word-ms "${WS_WORD_MS:-50}" --patches "${LONG_PATCHES:-10}" --out "$OUT/ws.json" ;;
                    pcm_p16) http_bench pcm_p16 "${CONC_HIGH:-64,128}" --format pcm --procs 16 ;;
                    mp3_p16) http_bench mp3_p16 "${CONC_HIGH:-64,128}" --format mp3 --procs 16 ;;
                    mp3_httpx) http_bench mp3_httpx "${CONC_HIGH:-64,128}" --format mp3 --client httpx ;;
                    pcm_httpx) http_bench pcm_httpx "${CONC_HIGH:-64,128}" --format pcm --client httpx ;;
                    *) log "unknown HTTP run $run" ;;
                esac || RC[$part]=$?
                # the service's metrics after each run (cumulative: the encoder pool's waits, TTFB, ...)
                curl -sf -m 10 "http://127.0.0.1:$PORT/metrics" | grep -E "^voxcpm_(encoder|time_to_first)" \
                    >"$OUT/metrics_after_$run.txt" 2>/dev/null
            done
            stop_service
            ;;
        http_env)  # HTTP_ROUNDS rounds of: BASELINE's service (when set), then this tree's in each of HTTP_VARIANTS
            # (';'-separated environments, '-' for none), at CONC in each of HTTP_ENV_FORMATS ("mp3" unless set), no
            # profiler: http_r<round>_{base,env<i>}_<format>_{a,b}.json (`tools/bench.py serving-report`)
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            RC[$part]=0
            IFS=';' read -r -a variants <<< "${HTTP_VARIANTS:--}"
            for round in $(seq 1 "${HTTP_ROUNDS:-1}"); do
                if [[ -n "${BASELINE:-}" ]]; then
                    if start_service "$BASELINE" "r${round}_base"; then
                        for fmt in ${HTTP_ENV_FORMATS:-mp3}; do
                            http_bench "r${round}_base_$fmt" "$CONC" --format "$fmt" || RC[$part]=$?
                        done
                    else
                        RC[$part]=start
                    fi
                    stop_service
                fi
                for v in "${!variants[@]}"; do
                    env_v="${variants[$v]}"; [[ $env_v == - ]] && env_v=""
                    log "variant env$v: ${env_v:-default environment}"
                    if SERVICE_ENV="$env_v" start_service "$ROOT" "r${round}_env$v"; then
                        for fmt in ${HTTP_ENV_FORMATS:-mp3}; do
                            http_bench "r${round}_env${v}_$fmt" "$CONC" --format "$fmt" || RC[$part]=$?
                        done
                    else
                        RC[$part]=start
                    fi
                    stop_service
                done
            done
            ;;
        http_api16)  # the service with 16 API processes, at CONC_HIGH
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            SERVICE_ENV="NANOVLLM_API_PROCESSES=16" start_service "$ROOT" api16 || { stop_service; RC[$part]=start; continue; }
            RC[$part]=0
            http_bench api16_pcm "${CONC_HIGH:-64,128}" --format pcm || RC[$part]=$?
            http_bench api16_mp3 "${CONC_HIGH:-64,128}" --format mp3 || RC[$part]=$?
            stop_service
            ;;
        gpu2)  # one GPU against two: the pool in-process (c=C1 on GPU 0, c=C2 on GPUs 0,1), then the service over HTTP
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            RC[$part]=0
            c1=${C1:-128} c2=${C2:-256}
            CONC=$c1 BENCH_ARGS="--max-num-seqs ${MAXSEQS:-128} --devices 0" bench voxcpm-serve "$OUT/pool_1gpu.json" \
                "$T_OURS" || RC[$part]=$?
            CONC=$c2 BENCH_ARGS="--max-num-seqs ${MAXSEQS:-128} --devices 0,1" bench voxcpm-serve "$OUT/pool_2gpu.json" \
                "$T_OURS" || RC[$part]=$?
            for n in 1 2; do
                devs=$([[ $n == 1 ]] && echo 0 || echo 0,1)
                c=$([[ $n == 1 ]] && echo "$c1" || echo "$c2")
                MAXSEQS=${MAXSEQS:-128} SERVICE_ENV="NANOVLLM_SERVERPOOL_DEVICES=$devs ${GPU2_ENV:-}" start_service "$ROOT" "gpu$n" \
                    || { stop_service; RC[$part]=start; continue; }
                for fmt in ${GPU2_FORMATS:-mp3 pcm}; do
                    PYSPY=$([[ $n == 2 && $fmt == mp3 ]] && echo "${HTTP_PYSPY-1}") http_bench "gpu${n}_$fmt" "$c" --format "$fmt" \
                        --procs "${GPU2_PROCS:-16}" || RC[$part]=$?
                done
                stop_service
            done
            ;;
        lora)  # runtime LoRA adapters (LORAS of rank LORA_RANK, every request using one) against the base model and a
            # merged start-up adapter, the pool at CONC: lora_base.json, lora_runtime.json, lora_merged.json; and the
            # runtime adapters with merged steps off (every step adds the terms): lora_runtime_terms.json
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            RC[$part]=0
            bench voxcpm-serve "$OUT/lora_base.json" "$T_OURS" || RC[$part]=$?
            BENCH_ARGS="${BENCH_ARGS:-} --loras ${LORAS:-4} --lora-rank ${LORA_RANK:-32}" \
                bench voxcpm-serve "$OUT/lora_runtime.json" "$T_OURS" || RC[$part]=$?
            VOXCPM_LORA_MERGED_STEPS=0 BENCH_ARGS="${BENCH_ARGS:-} --loras ${LORAS:-4} --lora-rank ${LORA_RANK:-32}" \
                bench voxcpm-serve "$OUT/lora_runtime_terms.json" "$T_OURS" || RC[$part]=$?
            python3 -c "from pathlib import Path; from tools.benchmarks.stream import random_adapters; \
random_adapters('$CKPT', 1, ${LORA_RANK:-32}, Path('/tmp/lora_merged'))" \
                2>&1 | tail -2 | tee -a "$LOG"
            OURS_ARGS="${OURS_ARGS:-} --pool-kwargs {\"lora_path\":\"/tmp/lora_merged/bench0\"}" \
                bench voxcpm-serve "$OUT/lora_merged.json" "$T_OURS" || RC[$part]=$?
            ;;
        burst)  # arrivals onto running streams, once per variant, BASELINE's engine first (today's tool over it)
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            RC[$part]=0
            burst_args=(--model "$CKPT" --running "${RUNNING:-128}" --burst "${BURST:-128}" --iters "${BURST_ITERS:-2}")
            trees=(.)
            if [[ -n "${BASELINE:-}" ]]; then
                cp -r tools/bench.py tools/subcommands.py tools/benchmarks "$BASELINE/tools/"
                trees=("$BASELINE" .)
            fi
            for tree in "${trees[@]}"; do
                variants="${BURST_VARIANTS:--}"
                [[ "$tree" != . ]] && variants="${BURST_BASE_VARIANTS:--}"
                tag=$([[ "$tree" == . ]] && echo new || echo base)
                i=0
                IFS=';' read -ra list <<<"$variants"
                for v in "${list[@]}"; do
                    i=$((i + 1))
                    [[ "$v" == - ]] && v=""
                    # shellcheck disable=SC2086  # the variant's flags split into words
                    (cd "$tree" && run_limited "${T_BURST:-150}" "burst-$tag-$i" python3 tools/bench.py arrival-burst \
                        "${burst_args[@]}" ${BURST_ARGS:-} $v --out "$OUT/burst_${tag}_$i.json") || RC[$part]=$?
                done
            done
            ;;
        ours_base)  # the pool benchmark of an earlier tree (BASELINE=dir, e.g. `git archive <commit> engine service
            # tools pyproject.toml | tar -x -C old`), with that tree's own stream benchmark, into ours_base.json
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            [[ -d "${BASELINE:-}" ]] || { log "ours_base needs BASELINE=dir (an earlier tree)"; RC[$part]=setup; continue; }
            pushd "$BASELINE" >/dev/null && bench_ours "$OUT/ours_base.json"
            RC[$part]=$?
            popd >/dev/null
            ;;
        rounds)  # BASELINE's pool benchmark and this tree's, alternating ROUNDS (3) times: rounds_{base,tree}_N.json
            # (what moves between runs, such as c=256's TTFB p95, compared round by round); with ROUND_ENV instead of
            # BASELINE (environment assignments, e.g. VOXCPM_EARLY_OUTPUTS=0), this tree in it: rounds_env_N.json
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            [[ -d "${BASELINE:-}" || -n "${ROUND_ENV:-}" ]] || {
                log "rounds needs BASELINE=dir (an earlier tree) or ROUND_ENV"; RC[$part]=setup; continue; }
            RC[$part]=0
            for r in $(seq 1 "${ROUNDS:-3}"); do
                if [[ -n "${ROUND_ENV:-}" ]]; then
                    # shellcheck disable=SC2086  # one word per assignment
                    (export ${ROUND_ENV}; bench_ours "$OUT/rounds_env_$r.json") || RC[$part]=$?
                else
                    pushd "$BASELINE" >/dev/null && { bench_ours "$OUT/rounds_base_$r.json" || RC[$part]=$?; }
                    popd >/dev/null
                fi
                bench_ours "$OUT/rounds_tree_$r.json" || RC[$part]=$?
            done
            ;;
        manifest)  # re-record this tree's kernel manifest (MANIFEST_NAME; a variant's: MANIFEST_KWARGS) on an empty
            # kernel cache; a copy in $OUT
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            target="engine/startup/kernel_manifests/${MANIFEST_NAME:-voxcpm2-sm90}.json"
            kwargs="${MANIFEST_KWARGS:-}"; [[ -n "$kwargs" ]] || kwargs="{}"
            TRITON_CACHE_DIR="$(mktemp -d)" run_limited "${T_MANIFEST:-300}" manifest python3 \
                tools/record_kernel_manifest.py --model "$CKPT" --max-num-seqs "${MAXSEQS:-128}" --out "$target" \
                --engine-kwargs "$kwargs"
            RC[$part]=$?
            cp "$target" "$OUT/" 2>/dev/null
            ;;
        manifest_check)  # the shipped manifests cover what an engine of this tree compiles: the recording's exercise
            # on an empty kernel cache with them precompiled, 0 JIT compiles or the part fails (MANIFEST_KWARGS: engine)
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            kwargs="${MANIFEST_KWARGS:-}"; [[ -n "$kwargs" ]] || kwargs="{}"
            run_limited "${T_MANIFEST:-300}" manifest-check python3 \
                tools/record_kernel_manifest.py --model "$CKPT" --max-num-seqs "${MAXSEQS:-128}" --check \
                --engine-kwargs "$kwargs"
            RC[$part]=$?
            ;;
        cold)  # cold start to /ready of the service (empty cache dir), BASELINE's tree and this one alternately,
            # COLD_ROUNDS times each (this tree once per ';'-separated COLD_VARIANTS entry: its environment, e.g.
            # "-;VOXCPM_PRECOMPILE=0", '-' for none); the times are the log's "service NAME ready in X s" lines
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            RC[$part]=0
            if [[ -n "${COLD_PREBUILT:-}" ]]; then  # the image's kernels, for a variant naming this folder as
                # NANOVLLM_PREBUILT_KERNELS_DIR (the GPU idle: the build step of an image needs none)
                run_limited 300 prebuilt python3 -m engine.startup.prebuild --out "$COLD_PREBUILT" ${COLD_PREBUILT_ARGS:-} || RC[$part]=prebuilt
            fi
            IFS=';' read -r -a variants <<< "${COLD_VARIANTS:--}"
            for round in $(seq 1 "${COLD_ROUNDS:-2}"); do
                if [[ -n "${BASELINE:-}" ]]; then
                    drop_caches
                    start_service "$BASELINE" "cold_base_$round" || RC[$part]=start
                    stop_service
                fi
                for v in "${!variants[@]}"; do
                    env_v="${variants[$v]}"; [[ $env_v == - ]] && env_v=""
                    name="cold_new_$round"; (( ${#variants[@]} > 1 )) && name="cold_new${v}_$round"
                    log "variant $name: ${env_v:-default environment}"
                    drop_caches
                    SERVICE_ENV="$env_v" start_service "$ROOT" "$name" || RC[$part]=start
                    stop_service
                done
            done
            if [[ -n "${COLD_PYSPY:-}" ]]; then  # one more start of this tree under py-spy (not counted: slower)
                PYSPY_START=1 start_service "$ROOT" cold_pyspy || RC[$part]=start
                stop_service
                sleep 3  # py-spy writes its file when the processes it follows end
                if [[ -s "$OUT/pyspy_start_cold_pyspy.txt" ]]; then  # the worker's start by phase; the raw record kept gzipped
                    python3 tools/profiler.py pyspy "$OUT/pyspy_start_cold_pyspy.txt" --phases \
                        --json "$OUT/pyspy_start_summary.json" 2>&1 | tee -a "$LOG"
                    gzip -f "$OUT/pyspy_start_cold_pyspy.txt"
                fi
            fi
            ;;
        http_base)
            { setup_wheels && setup_checkpoint; } || { RC[$part]=setup; continue; }
            [[ -d "${BASELINE:-}" ]] || { log "http_base needs BASELINE=dir (an earlier tree)"; RC[$part]=setup; continue; }
            start_service "$BASELINE" base || { stop_service; RC[$part]=start; continue; }
            PYSPY=1 http_bench base_mp3 "$HTTP_BASE_CONC" --format mp3
            RC[$part]=$?
            stop_service
            ;;
        *)
            log "unknown part '$part' (known: test check profile ours ours_base rounds manifest cold lora ours_window ours_hifi nano encode http http_env http_api16 gpu2 http_base burst fp8acc)"
            ;;
    esac
done

if [[ -f "$OUT/ours.json" && -f "$OUT/nano.json" ]]; then
    log "comparison (ours / nano-vllm-voxcpm):"
    python3 tools/bench.py compare "$OUT/ours.json" "$OUT/nano.json" --md "$OUT/compare.md" 2>&1 | tee -a "$LOG"
fi
summary=""
for part in $PARTS; do summary+=" $part=${RC[$part]:-?}"; done
if (( $(find "$OUT" -maxdepth 1 -type f | wc -l) > 7 )); then  # fewer files to copy back from the GPU host
    (cd "$OUT" && tar czf results.tgz --exclude bench.log --exclude results.tgz ./* && \
        find . -maxdepth 1 -type f ! -name bench.log ! -name results.tgz -delete)
fi
log "done in $((SECONDS - START))s; exit codes:$summary (124 = timed out); files: $(ls "$OUT" | tr '\n' ' ')"
