#!/usr/bin/env bash
# benchmarks/real_models.py on one H200 through the device tool, which takes at most 64 MiB along per call and
# gives an idle machine back after 30 s: five calls, back to back. Here, once:
#   bash ../shared/gpu/build_vllm_bundle.sh .gpu/vllm                                   # 3 parts, 44.7 MiB each
#   python benchmarks/carry_model.py split smollm2 --out .gpu/model --sizes 14.5 14.5 14.5  # 4 slices
#   pip download --no-deps ... -d .gpu/whl tomli-w gguf math-verify latex2sympy2_extended antlr4-python3-runtime
# Then the calls (carry = the folders each one takes along):
#   1. carry .gpu/vllm/part1 .gpu/model/slice1:      bash benchmarks/real_models_h200.sh copy
#   2. carry .gpu/vllm/part2 .gpu/model/slice2:      bash benchmarks/real_models_h200.sh copy
#   3. carry .gpu/vllm/part3 .gpu/model/slice3:      bash benchmarks/real_models_h200.sh copy
#   4. carry .gpu/model/slice4 .gpu/whl:             bash benchmarks/real_models_h200.sh start ENV...
#      (joins and checks the model, unpacks vLLM, converts the GGUF, starts the benchmark in its own session so
#      that it outlives the call, and follows it)
#   5. nothing carried:                              bash benchmarks/real_models_h200.sh follow
#      (follows it to its end or this call's limit; the results and a tar.gz of the runs land in $OUT)
# With BENCH=loop in every call, `start` runs benchmarks/loop_throughput.py instead (issue 34: tidal rl against
# vLLM alone and TRL; its parts in PARTS, default "offline tidal trl"; no ENV arguments), in /root/lt; `.gpu/whl`
# then also holds trl and accelerate (and datasets with its dependencies where the machine lacks them).
set -euo pipefail
stage=${1:?copy, start or follow}
shift || true
VLLM_PARTS=/root/vllm-parts
MODEL_PARTS=/root/model-parts
MODEL=/root/models/SmolLM2-135M-Instruct.Q4_1.gguf
BENCH=${BENCH:-real_models}            # or loop: benchmarks/loop_throughput.py
if [ "$BENCH" = loop ]; then WORK=/root/lt RESULTS=/root/lt-out; else WORK=/root/rm RESULTS=/root/rm-out; fi
PARTS=${PARTS:-offline tidal trl}      # BENCH=loop only
CALL_LIMIT=${CALL_LIMIT:-560}          # seconds this call follows the benchmark before it returns
BENCH_DEADLINE=${BENCH_DEADLINE:-1000} # seconds the benchmark may run, counted from `start`

export PYTHONPATH=$PWD/src:/tmp/site:/root/vllm-site
export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1 VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1
export TIDAL_CACHE_DIR=/root/tidal-cache

copy_parts() {
    mkdir -p "$VLLM_PARTS" "$MODEL_PARTS"
    for d in .gpu/vllm/part*; do [ -d "$d" ] && cp "$d"/* "$VLLM_PARTS"/; done
    for d in .gpu/model/slice*; do [ -d "$d" ] && cp "$d"/* "$MODEL_PARTS"/; done
    ls -l "$VLLM_PARTS" "$MODEL_PARTS"
}

follow() {  # until the benchmark ends or CALL_LIMIT; then its files into $OUT
    local pid
    pid=$(cat "$WORK/driver.pid")
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$CALL_LIMIT" ]; do
        sleep 30
        echo "--- $(date +%T) (${SECONDS}s)"
        for run in "$WORK"/*/rl; do
            [ -f "$run/orchestrator/metrics.jsonl" ] || continue
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
print(f"{run.parent.name}: step {last['step']} reward {last.get('reward/mean', float('nan')):.3f} "
      f"{last.get('time/step', 0):.1f}s/step evals {' '.join(scores)}")
EOF
        done
    done
    tail -5 "$WORK/driver.log" || true
    if [ "$BENCH" = loop ]; then  # logs and metrics of every run, no weights
        tar czf "$RESULTS/loop_throughput_raw.tar.gz" -C "$WORK" --exclude='*.safetensors' --exclude='*.pt' \
            --exclude='*.bin' --exclude='weights' --exclude='checkpoints' . 2>/dev/null || true
    fi
    cp "$RESULTS"/* "$OUT"/ 2>/dev/null || true
    cp "$WORK/driver.log" "$OUT"/ 2>/dev/null || true
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv || true
}

case "$stage" in
copy)
    copy_parts
    ;;
start)
    copy_parts
    (cd "$VLLM_PARTS" && cat vllm-site.tar.xz.[0-9][0-9] > vllm-site.tar.xz && sha256sum -c SHA256SUMS)
    [ -d /root/vllm-site/vllm ] || python3 -c "import tarfile; tarfile.open('$VLLM_PARTS/vllm-site.tar.xz').extractall('/root/vllm-site', filter='data')"
    python3 benchmarks/carry_model.py join "$MODEL_PARTS" --out "$MODEL"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl
    python3 -m tidal convert "$MODEL"
    mkdir -p "$WORK" "$RESULTS"
    if [ "$BENCH" = loop ]; then
        # shellcheck disable=SC2086  # PARTS: several words
        setsid nohup timeout $((BENCH_DEADLINE - SECONDS)) python3 benchmarks/loop_throughput.py \
            --model "$MODEL" --parts $PARTS --trl-site /tmp/site --workdir "$WORK" \
            --out "$RESULTS/loop_throughput_h200.json" > "$WORK/driver.log" 2>&1 < /dev/null &
    else
        setsid nohup python3 benchmarks/real_models.py --model "$MODEL" --suffix smollm2 --envs "$@" \
            --workdir "$WORK" --out "$RESULTS/real_models_h200.json" --deadline $((BENCH_DEADLINE - SECONDS)) \
            --raw "$RESULTS/real_models_raw.tar.gz" > "$WORK/driver.log" 2>&1 < /dev/null &
    fi
    echo $! > "$WORK/driver.pid"
    follow
    ;;
follow)
    follow
    ;;
*)
    echo "unknown stage $stage" >&2
    exit 2
    ;;
esac
