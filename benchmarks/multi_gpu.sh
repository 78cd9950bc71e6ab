#!/usr/bin/env bash
# The multi-GPU runs of the two- and eight-GPU issues, one stage per device call (each fits the 600-s limit).
#
# Run from the repository root on the lent machine, after the vLLM bundle is unpacked and its environment set
# (../shared/gpu/README.md; `source .gpu/setup.sh` does both) for the stages that start vLLM:
#
#   bash benchmarks/multi_gpu.sh STAGE [OUT]      # OUT: where results go (default $OUT, else /tmp/multi_gpu)
#
# Two GPUs (nvidia-h200-x2):
#   x2-tests    GPU tests that need two GPUs: FSDP2 / expert / context parallelism against one GPU, the NCCL
#               broadcast to vLLM, `tidal rl` over NCCL                         -> gpu_tests_h200x2.txt
#   x2-nccl     publish + load per step inside `tidal rl` (benchmarks/async_overlap.py, levels 0 and 2, eager
#               vLLM), NCCL against the filesystem backend in the same call   -> async_overlap_{nccl,filesystem}_h200x2.json
#   x2-disagg   prefill/decode disaggregation (a prefill server on GPU 0, a decode server on GPU 1, NixlConnector
#               when nixl imports, else ExampleConnector in /dev/shm) against two ordinary replicas: generation
#               throughput and time to first token, 8192-token prompts, 512 new tokens -> disagg_serving_h200x2.json
#   x2-ep-cp    tokens/s per GPU: the Qwen3-30B-A3B shape (8 layers) at ep = 2 against one GPU, Qwen3-4B at 32k
#               tokens at cp = 2 against one GPU                               -> trainer_mfu_ep_cp_h200x2.json
# Eight GPUs (nvidia-h200-x8; x8-fsdp-* also run on four):
#   x8-fsdp-4b  Qwen3-4B, 16k tokens per GPU, on 1 (with and without FSDP2), 2, 4 and 8 GPUs
#                                                                              -> trainer_mfu_scaling_4b_h200x8.json
#   x8-fsdp-8b  the same for Qwen3-8B                                          -> trainer_mfu_scaling_8b_h200x8.json
#   x8-64k      Qwen3-4B at 64k tokens per GPU on 8 GPUs (PRIME-RL's published shape)
#   x8-moe      the Qwen3-30B-A3B shape, all 48 layers, ep = 8                -> trainer_mfu_moe_ep8_h200x8.json
#   x8-async    `tidal rl`, 4 replicas + a 4-GPU trainer, NCCL weights (configs/bench/async_node_qwen3_1.7b.toml),
#               levels 0 and 2                                                 -> async_node_h200x8.json
set -euo pipefail
stage=${1:?usage: bash benchmarks/multi_gpu.sh STAGE [OUT]}
out=${2:-${OUT:-/tmp/multi_gpu}}
mkdir -p "$out"
mfu() { python3 benchmarks/trainer_mfu.py "$@"; }
mfu_ranks() { local n=$1; shift; python3 -m torch.distributed.run --standalone --nproc-per-node "$n" benchmarks/trainer_mfu.py "$@"; }
need_gpus() {
  local have; have=$(nvidia-smi --list-gpus | wc -l)
  if [ "$have" -lt "$1" ]; then echo "stage $stage needs $1 GPUs, this machine has $have" >&2; exit 2; fi
}
case "$stage" in
  x2-tests)
    need_gpus 2
    python3 -m pytest -v -s -p no:cacheprovider -o addopts= \
      "tests/gpu/test_numerics_gpu.py::test_two_gpus_match_one_gpu" \
      "tests/gpu/test_inference_gpu.py::test_nccl_broadcast_from_trainer_gpu0_to_vllm_gpu1" \
      tests/gpu/test_rl_nccl_gpu.py 2>&1 | tee "$out/gpu_tests_h200x2.txt" ;;
  x2-nccl)
    need_gpus 2
    for backend in nccl filesystem; do
      python3 benchmarks/async_overlap.py --levels 0 2 --max-steps 8 --timeout 130 \
        --workdir "/tmp/async_overlap_$backend" --out "$out/async_overlap_${backend}_h200x2.json" \
        -- --trainer.publish.type "$backend" --inference.vllm.enforce-eager true
    done ;;
  x2-disagg)
    need_gpus 2
    python3 benchmarks/disagg_serving.py --prompt-tokens 8192 --new-tokens 512 --requests 64 --concurrency 16 \
      --out "$out/disagg_serving_h200x2.json" ;;
  x2-ep-cp)
    need_gpus 2
    mfu --models qwen3-30b-a3b:8 --seq 16384 --impls tidal:default --out "$out/ep1.json"
    mfu_ranks 2 --models qwen3-30b-a3b:8 --seq 16384 --impls tidal:default --set ep=2 --out "$out/ep2.json"
    mfu --models qwen3-4b --seq 32768 --docs single --impls tidal:default --out "$out/cp1.json"
    mfu_ranks 2 --models qwen3-4b --seq 32768 --docs single --impls tidal:default --set cp=2 --out "$out/cp2.json"
    mfu --merge "$out"/ep1.json "$out"/ep2.json "$out"/cp1.json "$out"/cp2.json --out "$out/trainer_mfu_ep_cp_h200x2.json" ;;
  x8-fsdp-4b|x8-fsdp-8b)
    model=qwen3-${stage#x8-fsdp-}
    gpus=$(nvidia-smi --list-gpus | wc -l)
    parts=()
    for n in 1 2 4 8; do
      [ "$n" -le "$gpus" ] || break
      # one GPU trains without FSDP2 by default: its FSDP2 run too, so that scaling is read both against the
      # fastest one-GPU step and against the same sharding code
      impls=tidal:default; [ "$n" -gt 1 ] || impls=tidal:default,tidal:default+fsdp
      mfu_ranks "$n" --models "$model" --seq 16384 --docs single --impls "$impls" --out "$out/${model}_$n.json"
      parts+=("$out/${model}_$n.json")
    done
    mfu --merge "${parts[@]}" --out "$out/trainer_mfu_scaling_${model#qwen3-}_h200x$gpus.json" ;;
  x8-64k)
    need_gpus 8
    mfu_ranks 8 --models qwen3-4b --seq 65536 --docs single --impls tidal:default --out "$out/trainer_mfu_4b_64k_h200x8.json" ;;
  x8-moe)
    need_gpus 8
    mfu_ranks 8 --models qwen3-30b-a3b --seq 16384 --impls tidal:default --set ep=8 --out "$out/trainer_mfu_moe_ep8_h200x8.json" ;;
  x8-async)
    need_gpus 8
    python3 benchmarks/async_overlap.py --config configs/bench/async_node_qwen3_1.7b.toml --levels 0 2 \
      --max-steps 8 --timeout 270 --out "$out/async_node_h200x8.json" ;;
  *)
    echo "unknown stage $stage (see the header of benchmarks/multi_gpu.sh)" >&2; exit 2 ;;
esac
