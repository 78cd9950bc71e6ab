#!/usr/bin/env bash
# benchmarks/real_models.py and/or benchmarks/loop_throughput.py on one H200 through the device tool, which takes
# at most 64 MiB along per call and gives an idle machine back after 30 s: six calls, back to back. Here, once:
#   bash ../shared/gpu/build_vllm_bundle.sh .gpu/vllm                                   # 3 parts, 44.7 MiB each
#   python benchmarks/carry_model.py split smollm2 --out .gpu/model --sizes 9 9 9 27  # 5 slices
#   (a call's 64 MiB hold one 44.7 MiB vLLM part, one slice and the working tree, ~6.2 MiB on 2026-12-05)
#   pip download --no-deps ... -d .gpu/whl tomli-w gguf math-verify latex2sympy2_extended antlr4-python3-runtime bm25s
#   (BENCH=loop or both: also trl accelerate datasets dill multiprocess xxhash fsspec; pandas, 12 MB, in .gpu/whl2
#    where the machine lacks it: `copy` prints which of these the machine has)
# Then the calls (carry = the folders each one takes along):
#   1. carry .gpu/vllm/part1 .gpu/model/slice1:      bash benchmarks/real_models_h200.sh copy
#   2. carry .gpu/vllm/part2 .gpu/model/slice2:      bash benchmarks/real_models_h200.sh copy
#   3. carry .gpu/vllm/part3 .gpu/model/slice3:      bash benchmarks/real_models_h200.sh copy
#   4. carry .gpu/model/slice4 .gpu/whl [.gpu/whl2]: bash benchmarks/real_models_h200.sh copy
#   5. carry .gpu/model/slice5:                      bash benchmarks/real_models_h200.sh start ENV...
#      (joins and checks the model, unpacks vLLM unless the copy call that brought its last part did so behind
#      the calls after it, converts the GGUF, starts the benchmark(s) in their own session
#      so that they outlive the call, and follows them)
#   (MODEL_ASSET=qwen: Qwen2.5-Coder-0.5B-Instruct, the recipes' `_qwen05b` configs, carried with its tied
#    embedding once (379 MiB, not 469; it converts to the same weights: carry_model.py's docstring); slices from
#    `carry_model.py split qwen2.5-coder-0.5b --one-embedding --out .gpu/qwen --sizes 13 13 13 52 57.7 57.7 57.7 57.7`
#    take nine calls: slices 1-3 beside the vLLM parts, 4 beside .gpu/whl, 5-8 alone, 9 with `start`;
#    a vLLM part, a slice and the working tree must fit 64 MiB: 46.9 + 9.4 + 9.7 MB fit on 2026-12-06,
#    46.9 + 9.4 + 10.4 MB did not (the tool counts a little more than the bytes);
#    the tree grows with every results file, so check `git ls-files -z | xargs -0 du -cb` before a sequence)
#   6. nothing carried:                              bash benchmarks/real_models_h200.sh follow
#      (follows them to their end or this call's limit; results and a tar.gz of the runs land in $OUT)
# BENCH picks what `start` runs: real_models (default; ENV... are its --envs, e.g. alphabet_sort:short@1e-4 or
# tool_use+12@3e-5, MAX_STEPS its --max-steps, EVAL_INTERVAL its --eval-interval, SAMPLES_INTERVAL its
# --samples-interval, default 2), loop
# (benchmarks/loop_throughput.py, issue 34: tidal rl against vLLM alone and TRL; its parts in PARTS, default
# "offline tidal trl", LOOP_ARGS added to its command; no ENV arguments), or both side by side on the one GPU
# (each then measures under the other's load: say so with their numbers), or loop_then_real_models: the loop
# benchmark alone on the GPU, then real_models with what is left of BENCH_DEADLINE. Every call names the same
# BENCH. BENCH=distill (issue 38, with MODEL_ASSET=qwen: the teacher) runs benchmarks/distill_vs_rl.py: the
# teacher without layers DV_DROP as the student, then RL, RL with a curriculum and distillation from it
# side by side (DV_STEPS its --steps, default 40; DV_DROP its --drop, default 8,16; DV_BUDGET, DV_UNIT and
# DV_EVAL its --budget, --budget-unit and --eval-interval, each run stopped at its first eval past the budget;
# DV_ARGS more of its flags; ENV... given:
# real_models.py on them beside it, with MAX_STEPS). BENCH=vlm (issue 36, SmolLM2's slices) builds a
# model of SmolVLM-256M's shape from the converted SmolLM2 (tidal.models.smolvlm_shape: random tower and
# connector), measures SFT's picture preparation (benchmarks/picture_prep.py) and its train step against the
# HF model's own (benchmarks/vlm_step.py) and RL's tower once per shared picture (vlm_rl_step.py; VLM_PREP=0,
# VLM_STEP=0 or VLM_RL_STEP=0 skips each; VLM_RUN=0 skips what follows), then runs real_models.py with
# `--suffix smolvlm` on ENV... (default shapes): SFT warm-up, RL,
# held-out before and after; the RL run's metrics hold the step times and the bf16 mismatch KL.
set -euo pipefail
stage=${1:?copy, start or follow}
shift || true
VLLM_PARTS=/root/vllm-parts
MODEL_PARTS=/root/model-parts
WHEELS=/root/whl
MODEL_ASSET=${MODEL_ASSET:-smollm2}    # smollm2 (slices in .gpu/model) or qwen (Qwen2.5-Coder-0.5B, in .gpu/qwen)
case "$MODEL_ASSET" in
smollm2) MODEL=/root/models/SmolLM2-135M-Instruct.Q4_1.gguf SUFFIX=smollm2 SLICES=.gpu/model ;;
qwen) MODEL=/root/models/qwen2.5-coder-0.5b-instruct.gguf SUFFIX=qwen05b SLICES=.gpu/qwen ;;
*) echo "MODEL_ASSET is smollm2 or qwen, not $MODEL_ASSET" >&2; exit 2 ;;
esac
BENCH=${BENCH:-real_models}            # real_models, loop, both, loop_then_real_models, distill or vlm
PARTS=${PARTS:-offline tidal trl}      # loop only; "offline tidal|trl": two loop_throughput.py side by side
LOOP_ARGS=${LOOP_ARGS:-}               # loop only: more loop_throughput.py flags
MAX_STEPS=${MAX_STEPS:-}               # real_models only: every RL run's max_steps
EVAL_INTERVAL=${EVAL_INTERVAL:-}       # real_models only: every RL run's online eval interval
SAMPLES_INTERVAL=${SAMPLES_INTERVAL:-2} # real_models only: every RL run's samples.jsonl interval
CALL_LIMIT=${CALL_LIMIT:-560}          # seconds this call follows the benchmark before it returns
BENCH_DEADLINE=${BENCH_DEADLINE:-1000} # seconds the benchmark may run, counted from `start`
RM_WORK=/root/rm RM_OUT=/root/rm-out LT_WORK=/root/lt LT_OUT=/root/lt-out DV_WORK=/root/dv
IFS='|' read -r -a LOOPS <<< "$PARTS"
LT_WORKS=$LT_WORK
for ((i = 2; i <= ${#LOOPS[@]}; i++)); do LT_WORKS="$LT_WORKS $LT_WORK$i"; done
case "$BENCH" in
real_models | vlm) WORKS="$RM_WORK" ;;
distill) WORKS="$DV_WORK $RM_WORK" ;;
loop) WORKS="$LT_WORKS" ;;
both | loop_then_real_models) WORKS="$RM_WORK $LT_WORKS" ;;
*) echo "BENCH is real_models, loop, both, loop_then_real_models, distill or vlm, not $BENCH" >&2; exit 2 ;;
esac

export PYTHONPATH=$PWD/src:/tmp/site:/root/vllm-site PATH=/tmp/site/bin:$PATH  # the wheels' scripts (py-spy)
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
export TIDAL_CACHE_DIR=/root/tidal-cache

copy_parts() {
    mkdir -p "$VLLM_PARTS" "$MODEL_PARTS" "$WHEELS"
    local f
    for f in .gpu/vllm/part*/*; do  # a part already here is not written again: an unpack may be reading it
        [ -f "$f" ] || continue
        [ "$(stat -c%s "$f")" = "$(stat -c%s "$VLLM_PARTS/${f##*/}" 2>/dev/null)" ] || cp "$f" "$VLLM_PARTS"/
    done
    for d in "$SLICES"/slice*; do [ -d "$d" ] && cp "$d"/* "$MODEL_PARTS"/; done
    for d in .gpu/whl*; do [ -d "$d" ] && cp "$d"/*.whl "$WHEELS"/; done
    ls -l "$VLLM_PARTS" "$MODEL_PARTS" "$WHEELS"
    for m in pandas datasets accelerate peft pyarrow transformers huggingface_hub; do  # what the machine has
        python3 -c "import $m; print('have $m', $m.__version__)" 2>/dev/null || echo "lacks $m"
    done
    # the code recipe's sandbox: without bubblewrap real_models.py runs its code under rlimits only (noted)
    PYTHONPATH=$PWD/src python3 -c "from tidal.envs import bwrap; print('bwrap:', bwrap.probe() or 'works')" || true
}

UNPACK_PID=/root/vllm-unpack.pid
unpack_vllm() {  # join the parts, check the whole, extract through a temporary folder (never half a vllm-site)
    (cd "$VLLM_PARTS" && cat vllm-site.tar.xz.[0-9][0-9] > vllm-site.tar.xz && sha256sum --quiet -c SHA256SUMS) ||
        return 1
    rm -rf /root/vllm-site.part
    python3 -c "import tarfile; tarfile.open('$VLLM_PARTS/vllm-site.tar.xz').extractall('/root/vllm-site.part', filter='data')"
    mv /root/vllm-site.part /root/vllm-site
}

unpack_vllm_behind() {  # once every part is here, unpack while the next copy calls run (saves `start` ~the unpack)
    [ -d /root/vllm-site/vllm ] && return 0
    [ -f "$UNPACK_PID" ] && kill -0 "$(cat "$UNPACK_PID")" 2>/dev/null && return 0
    [ "$(ls "$VLLM_PARTS"/vllm-site.tar.xz.[0-9][0-9] 2>/dev/null | wc -l)" -ge 3 ] || return 0
    setsid nohup bash "$0" _unpack > /root/vllm-unpack.log 2>&1 < /dev/null &
    echo $! > "$UNPACK_PID"
    echo "vLLM's parts are all here: unpacking behind the next calls (/root/vllm-unpack.log)"
}

wait_for_unpack() {  # an unpack started by a copy call: let it finish (a failed one is redone by `start`)
    [ -f "$UNPACK_PID" ] || return 0
    while kill -0 "$(cat "$UNPACK_PID")" 2>/dev/null; do sleep 1; done
    cat /root/vllm-unpack.log
}

summary() {  # one line per RL run: step, reward, step time, online evals
    local run=$1
    python3 - "$run" <<'EOF'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
rows = [json.loads(l) for l in (run / "orchestrator" / "metrics.jsonl").read_text().splitlines()]
last = rows[-1]
evals = run / "orchestrator" / "online_eval.jsonl"
scores = []
if evals.exists():
    for line in evals.read_text().splitlines():
        e = json.loads(line)
        for name, r in e["envs"].items():
            if "avg@1" in r:
                scores.append(f"{e['step']}{'F' if e['final'] else ''}:{r['avg@1']['mean']:.3f}")
print(f"{run.parent.name}/{run.name}: step {last['step']} reward {last.get('reward/mean', float('nan')):.3f} "
      f"{last.get('time/step', 0):.1f}s/step evals {' '.join(scores)}")
EOF
}

SEQUENCE=/root/sequence  # loop_then_real_models: the driver of the sequence, its pid and log
running() {  # true while a started driver still runs
    local work
    for work in $WORKS $SEQUENCE; do
        [ -f "$work/driver.pid" ] && kill -0 "$(cat "$work/driver.pid")" 2>/dev/null && return 0
    done
    return 1
}

follow() {  # until the benchmarks end or CALL_LIMIT; then their files into $OUT
    # a round is a 30 s sleep and the summaries, and the files after the loop take ~10 s more: stop a round
    # early, so that a CALL_LIMIT near the call's own limit still brings the files back (on 2026-12-07 a
    # CALL_LIMIT of 588 in a 600 s call overran it, and the call ended with nothing under $OUT)
    while running && [ $((SECONDS + 45)) -lt "$CALL_LIMIT" ]; do
        sleep 30
        echo "--- $(date +%T) (${SECONDS}s)"
        for run in $RM_WORK/*/rl /root/lt*/loop/rl /root/lt*/vs_trl/rl $DV_WORK/rl $DV_WORK/curriculum $DV_WORK/distill; do
            [ -f "$run/orchestrator/metrics.jsonl" ] && { summary "$run" || true; }
        done
    done
    for work in $WORKS; do tail -5 "$work/driver.log" || true; done
    if [ -d "$LT_WORK" ]; then  # logs and metrics of every run (driver logs too), no weights
        tar czf "$LT_OUT/loop_throughput_raw.tar.gz" -C /root --exclude='*.safetensors' --exclude='*.pt' \
            --exclude='*.bin' --exclude='weights' --exclude='checkpoints' --exclude='final' \
            --exclude='rollouts' --exclude='states' \
            $(cd /root && ls -d lt lt[0-9] 2>/dev/null) 2>/dev/null || true
    fi
    if [ -d "$DV_WORK" ]; then  # distill_vs_rl's runs: logs, metrics, evals, no weights (the student's either)
        tar czf "$RM_OUT/distill_curriculum_raw.tar.gz" -C /root --exclude='*.safetensors' --exclude='*.pt' \
            --exclude='*.bin' --exclude='weights' --exclude='checkpoints' --exclude='final' \
            --exclude='rollouts' --exclude='states' dv 2>/dev/null || true
    fi
    [ -f "$RM_WORK/driver.log" ] && cp "$RM_WORK/driver.log" "$OUT/real_models_driver.log"
    cp "$RM_OUT"/* "$LT_OUT"/* "$OUT"/ 2>/dev/null || true
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv || true
}

start_sequence() {  # the loop benchmark alone, then real_models: in their own session, so they outlive the call
    mkdir -p "$SEQUENCE"
    BENCH_STARTED=$(date +%s) START_OFFSET=$SECONDS setsid nohup bash "$0" _sequence "$@" > "$SEQUENCE/driver.log" 2>&1 < /dev/null &
    echo $! > "$SEQUENCE/driver.pid"
}

sequence() {  # (the `_sequence` stage) start_loop, wait for every loop driver, then start_real_models
    local work pid
    start_loop
    for work in $LT_WORKS; do
        pid=$(cat "$work/driver.pid")
        while kill -0 "$pid" 2>/dev/null; do sleep 5; done
    done
    echo "$(date +%T) loop done; real_models with $((BENCH_DEADLINE - SECONDS)) s left"
    start_real_models "$@"
    pid=$(cat "$RM_WORK/driver.pid")
    while kill -0 "$pid" 2>/dev/null; do sleep 5; done
}

start_real_models() {  # MODEL and SUFFIX: the GGUF's (or, BENCH=vlm, the VLM's built from it)
    mkdir -p "$RM_WORK" "$RM_OUT"
    local flags=()
    [ -n "$MAX_STEPS" ] && flags=(--max-steps "$MAX_STEPS")
    [ -n "$EVAL_INTERVAL" ] && flags+=(--eval-interval "$EVAL_INTERVAL")
    [ -n "$SAMPLES_INTERVAL" ] && flags+=(--samples-interval "$SAMPLES_INTERVAL")
    setsid nohup python3 benchmarks/real_models.py --model "$MODEL" --suffix "$SUFFIX" --envs "$@" "${flags[@]}" \
        --workdir "$RM_WORK" --out "$RM_OUT/real_models_h200.json" --deadline $((BENCH_DEADLINE - SECONDS)) \
        --raw "$RM_OUT/real_models_raw.tar.gz" > "$RM_WORK/driver.log" 2>&1 < /dev/null &
    echo $! > "$RM_WORK/driver.pid"
}

start_distill() {  # benchmarks/distill_vs_rl.py in its own session; its results and logs land in $RM_OUT
    mkdir -p "$DV_WORK" "$RM_OUT"
    # the teacher's layers the student lacks (every other one leaves Qwen2.5-Coder-0.5B writing garbage)
    setsid nohup python3 benchmarks/distill_vs_rl.py --teacher "$MODEL" --workdir "$DV_WORK" --drop "${DV_DROP:-8,16}" \
        --out "$RM_OUT/distill_curriculum_h200.json" --steps "${DV_STEPS:-40}" --timeout $((BENCH_DEADLINE - SECONDS)) \
        --budget "${DV_BUDGET:-0}" --budget-unit "${DV_UNIT:-samples}" --eval-interval "${DV_EVAL:-0}" \
        ${DV_ARGS:-} > "$DV_WORK/driver.log" 2>&1 < /dev/null &
    echo $! > "$DV_WORK/driver.pid"
}

start_loop() {  # one loop_throughput.py per '|'-separated group of PARTS, each in its own folder
    local i work suffix
    mkdir -p "$LT_OUT"
    for ((i = 1; i <= ${#LOOPS[@]}; i++)); do
        work=$LT_WORK suffix=""
        [ "$i" -gt 1 ] && work=$LT_WORK$i suffix=_$i
        mkdir -p "$work"
        # shellcheck disable=SC2086  # the parts and LOOP_ARGS: several words
        setsid nohup timeout $((BENCH_DEADLINE - SECONDS)) python3 benchmarks/loop_throughput.py \
            --model "$MODEL" --parts ${LOOPS[$((i - 1))]} --trl-site /tmp/site --workdir "$work" $LOOP_ARGS \
            --out "$LT_OUT/loop_throughput_h200$suffix.json" > "$work/driver.log" 2>&1 < /dev/null &
        echo $! > "$work/driver.pid"
    done
}

case "$stage" in
copy)
    copy_parts
    unpack_vllm_behind
    ;;
start)
    copy_parts
    wait_for_unpack
    [ -d /root/vllm-site/vllm ] || unpack_vllm
    python3 benchmarks/carry_model.py join "$MODEL_PARTS" --out "$MODEL"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl
    python3 -m tidal convert "$MODEL"
    case "$BENCH" in
    real_models) start_real_models "$@" ;;
    loop) start_loop ;;
    distill) start_distill; [ "$#" -eq 0 ] || start_real_models "$@" ;;  # ENV...: real_models beside it
    vlm)
        local_text=$(python3 -c "from tidal.models import resolve_model_name; print(resolve_model_name('$MODEL'))")
        [ -f /root/models/smolvlm-shape/config.json ] ||
            python3 -m tidal.models.smolvlm_shape --text "$local_text" --out /root/models/smolvlm-shape
        MODEL=/root/models/smolvlm-shape SUFFIX=smolvlm
        [ "$#" -gt 0 ] || set -- shapes
        # SFT's picture preparation on this host's cores against the in-process baseline (~40 s, GPU idle)
        mkdir -p "$RM_OUT"
        [ "${VLM_PREP:-1}" = 0 ] ||
            timeout 180 python3 benchmarks/picture_prep.py --model "$MODEL" --steps 4 --step-seconds 1 \
                --out "$RM_OUT/picture_prep_gpu_host.json" > "$RM_OUT/picture_prep.log" 2>&1 ||
            echo "picture_prep.py failed: $RM_OUT/picture_prep.log"
        # where the SFT step's GPU time goes: tidal's train step against the HF model in bf16 (~90 s)
        [ "${VLM_STEP:-1}" = 0 ] ||
            timeout 240 python3 benchmarks/vlm_step.py --model "$MODEL" --out "$RM_OUT/vlm_step_gpu.json" \
                > "$RM_OUT/vlm_step.log" 2>&1 || echo "vlm_step.py failed: $RM_OUT/vlm_step.log"
        # RL's tower once per sample against once per shared picture, two groups of eight (~30 s)
        [ "${VLM_RL_STEP:-1}" = 0 ] ||
            timeout 180 python3 benchmarks/vlm_rl_step.py --model "$MODEL" --groups 2 --group-size 8 \
                --out "$RM_OUT/vlm_rl_step_gpu.json" > "$RM_OUT/vlm_rl_step.log" 2>&1 ||
            echo "vlm_rl_step.py failed: $RM_OUT/vlm_rl_step.log"
        [ "${VLM_RUN:-1}" = 0 ] || start_real_models "$@"  # VLM_RUN=0: the step benchmarks alone
        ;;
    both) start_real_models "$@"; start_loop ;;
    loop_then_real_models) start_sequence "$@" ;;
    esac
    follow
    ;;
_unpack)  # started by unpack_vllm_behind, in its own session so that it outlives the copy call
    unpack_vllm
    ;;
_sequence)  # started by start_sequence: SECONDS counts from the `start` call's own start
    SECONDS=$(( $(date +%s) - BENCH_STARTED + ${START_OFFSET:-0} ))
    sequence "$@"
    ;;
follow)
    follow
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
