#!/usr/bin/env bash
# A short second round of benchmarks/real_models.py's recipes on a fresh H200 (after real_models_h200.sh's
# copy calls 1-3): alphabet_sort at lr 1e-4 from the base model and tool_use from a 6-step warm-up, 30 RL
# steps each, eager vLLM (no graph capture: the start is most of so short a call). Online evals to $OUT.
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site:/root/vllm-site VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_HOST_IP=127.0.0.1
export VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1 TIDAL_CACHE_DIR=/root/tidal-cache
mkdir -p /root/vllm-parts /root/model-parts
cp .gpu/model/slice4/* /root/model-parts/
(cd /root/vllm-parts && cat vllm-site.tar.xz.[0-9][0-9] > vllm-site.tar.xz && sha256sum -c SHA256SUMS) || exit 1
python3 -c "import tarfile; tarfile.open('/root/vllm-parts/vllm-site.tar.xz').extractall('/root/vllm-site', filter='data')"
M=/root/models/SmolLM2-135M-Instruct.Q4_1.gguf
python3 benchmarks/carry_model.py join /root/model-parts --out $M || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl
python3 -m tidal convert $M
W=/root/r2
mkdir -p $W
G=(--inference.vllm.gpu-memory-utilization 0.05 --inference.vllm.extra-args '["--kv-cache-memory-bytes", "4G"]'
   --inference.vllm.enforce-eager --max-steps 30 --trainer.ckpt.interval 30)
python3 -m tidal rl @ examples/alphabet_sort/rl_smollm2.toml --model.name $M --output-dir $W/as \
    --trainer.optim.lr 1e-4 "${G[@]}" > $W/as.log 2>&1 &
(python3 -m tidal sft @ examples/tool_use/sft_smollm2.toml --model.name $M --output-dir $W/sft --max-steps 6 \
    --scheduler.warmup-steps 1 > $W/sft.log 2>&1 &&
 python3 -m tidal rl @ examples/tool_use/rl_smollm2.toml --model.name $W/sft/final --output-dir $W/tu "${G[@]}" \
    > $W/tu.log 2>&1) &
while true; do
    sleep 20
    for r in as tu; do
        for f in online_eval metrics; do
            [ -f $W/$r/orchestrator/$f.jsonl ] && cp $W/$r/orchestrator/$f.jsonl $OUT/${r}_$f.jsonl
        done
        [ -f $OUT/${r}_online_eval.jsonl ] && python3 -c "import json;print('$r',[(e['step'],[round(v['avg@1']['mean'],3) for v in e['envs'].values() if 'avg@1' in v]) for e in map(json.loads,open('$OUT/${r}_online_eval.jsonl'))])"
    done
    cp $W/sft/metrics.jsonl $OUT/sft_metrics.jsonl 2>/dev/null
    echo "--- ${SECONDS}s"
done
