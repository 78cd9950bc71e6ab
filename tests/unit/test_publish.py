"""The weights backend: `setup_publisher`, the NCCL handshake (trainer → announcement → orchestrator → server
engine) with the NCCL transfer replaced by an in-memory wire, and how `tidal rl` resolves the one setting."""

import asyncio
import json
import queue
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tidal.config.inference import InferenceConfig, NcclRendezvous
from tidal.config.loader import load_config, parse_args
from tidal.config.rl import FilesystemPublish, NcclPublish, RLConfig
from tidal.errors import UserError
from tidal.inference.types import ServerVersion, WeightUpdateReport
from tidal.launcher.split import split_config
from tidal.orchestrator.policy import PolicyWatcher
from tidal.trainer.parallel import DistInfo
from tidal.trainer.publish import FilesystemPublisher, NcclPublisher, setup_publisher
from tidal.transport.nccl import (
    ANNOUNCEMENT,
    RENDEZVOUS_ENV,
    BroadcastHeader,
    TensorMeta,
    announced_step,
    fields_of,
    is_announcement,
)
from tidal.transport.weights import latest_published, list_published

CPU = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
RENDEZVOUS = {"master_address": "127.0.0.1", "master_port": 29555, "world_size": 2}


def small_model() -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen3ForCausalLM(config)  # fp32, as the trainer's master weights


def served(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(dtype) for name, p in model.named_parameters()}


# ---- factory --------------------------------------------------------------------------------------------


def test_setup_publisher_builds_the_backend_the_type_names(tmp_path: Path) -> None:
    assert isinstance(setup_publisher(FilesystemPublish(), tmp_path, None), FilesystemPublisher)
    nccl = NcclPublish(host="10.0.0.7", port=29601, inference_world_size=4)
    sender = setup_publisher(nccl, tmp_path, torch.bfloat16, info=CPU)
    assert isinstance(sender, NcclPublisher) and sender.broadcaster is not None
    assert sender.broadcaster.rendezvous == {
        "master_address": "10.0.0.7",
        "master_port": 29601,
        "world_size": 5,
    }
    other_rank = DistInfo(rank=1, world_size=2, local_rank=1, local_world_size=2, device=torch.device("cpu"))
    follower = setup_publisher(nccl, tmp_path, torch.bfloat16, info=other_rank)
    assert isinstance(follower, NcclPublisher) and follower.broadcaster is None  # only rank 0 joins the group
    with pytest.raises(ValueError, match="LoRA"):
        setup_publisher(nccl, tmp_path, None, adapter_config={"r": 8})


def test_publish_type_is_a_tagged_choice_with_one_line_errors() -> None:
    config = load_config(RLConfig, [], parse_args(["--trainer.publish.type", "nccl"]).overrides)
    assert isinstance(config.trainer.publish, NcclPublish)
    with pytest.raises(UserError) as error:
        load_config(RLConfig, [], parse_args(["--trainer.publish.type", "ipc"]).overrides)
    assert "trainer.publish" in str(error.value) and len(str(error.value).splitlines()) == 1


# ---- NCCL publisher (trainer side) ----------------------------------------------------------------------


class RecordingBroadcaster:
    """Records what rank 0 would broadcast, and checks the step was announced before the group opened."""

    rendezvous = RENDEZVOUS

    def __init__(self, output_dir: Path):
        self.output_dir = output_dir
        self.opened = 0
        self.sent: list[tuple[BroadcastHeader, dict[str, torch.Tensor]]] = []

    def open(self) -> None:
        latest = latest_published(self.output_dir)
        assert latest is not None and is_announcement(latest[1]), (
            "the workers join only once a step is announced"
        )
        self.opened += 1

    def send(self, header: BroadcastHeader, tensors: Any) -> None:
        self.sent.append((header, dict(tensors)))

    def close(self) -> None:
        pass


def test_nccl_publish_announces_then_broadcasts_the_served_dtype(tmp_path: Path) -> None:
    model = small_model()
    wire = RecordingBroadcaster(tmp_path)
    publisher = NcclPublisher(tmp_path, keep_last=2, dtype=torch.bfloat16, broadcaster=wire)
    for step in (1, 2, 3):
        path = publisher.publish(step, model, None, CPU)
        assert announced_step(str(path)) == step and is_announcement(path)
    assert wire.opened == 1  # one group for the whole run
    assert [s for s, _ in list_published(tmp_path)] == [2, 3]  # announcements are pruned like checkpoints
    summary = json.loads((tmp_path / "weights" / "step_3" / ANNOUNCEMENT).read_text())
    assert summary["step"] == 3 and summary["master_port"] == 29555
    header, tensors = wire.sent[-1]
    expected = served(model, torch.bfloat16)
    assert header.step == 3 and [t.name for t in header.tensors] == list(expected)
    assert {t.dtype for t in header.tensors} == {"bfloat16"}  # fp32 masters are cast before they travel
    assert "lm_head.weight" not in expected  # tied: vLLM re-ties it to the embedding
    for meta in header.tensors:
        assert tensors[meta.name].dtype == torch.bfloat16 and tuple(tensors[meta.name].shape) == meta.shape
        assert torch.equal(tensors[meta.name], expected[meta.name])


def test_nccl_publish_refuses_non_finite_weights_before_announcing(tmp_path: Path) -> None:
    model = small_model()
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")
    wire = RecordingBroadcaster(tmp_path)
    with pytest.raises(UserError, match=r"step_1: tensor model\.norm\.weight has NaN/inf"):
        NcclPublisher(tmp_path, 3, None, wire).publish(1, model, None, CPU)
    assert wire.sent == [] and list_published(tmp_path) == []


def test_nccl_restore_broadcasts_the_resumed_step_again_but_filesystem_only_when_missing(
    tmp_path: Path,
) -> None:
    model = small_model()
    wire = RecordingBroadcaster(tmp_path / "nccl")
    nccl = NcclPublisher(tmp_path / "nccl", 3, None, wire)
    nccl.publish(4, model, None, CPU)
    nccl.restore(4, model, None, CPU)  # servers restarted from the base model: they need step 4 again
    assert [h.step for h, _ in wire.sent] == [4, 4]
    from tidal.models.tiny import build_tokenizer

    files, tokenizer = FilesystemPublisher(tmp_path / "fs"), build_tokenizer()
    files.restore(4, model, tokenizer, CPU)
    written = (tmp_path / "fs" / "weights" / "step_4" / "model.safetensors").stat().st_mtime_ns
    files.restore(4, model, tokenizer, CPU)
    assert (tmp_path / "fs" / "weights" / "step_4" / "model.safetensors").stat().st_mtime_ns == written


def test_wire_formats_round_trip_and_fit_each_vllm_release() -> None:
    header = BroadcastHeader(7, (TensorMeta("a.weight", "bfloat16", (3, 4)), TensorMeta("b", "float32", ())))
    assert BroadcastHeader.decode(header.encode()) == header
    info = header.update_info()
    assert info["names"] == ["a.weight", "b"] and info["shapes"] == [[3, 4], []]
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    kept = fields_of(NCCLWeightTransferUpdateInfo, info)  # this release keeps `packed` on the init info
    assert NCCLWeightTransferUpdateInfo(**kept).dtype_names == ["bfloat16", "float32"]
    assert announced_step("/run/weights/step_12") == 12 and announced_step("/models/base") is None


# ---- the handshake across the three processes, NCCL replaced by an in-memory wire ----------------------


class Wire:
    """Stands in for the NCCL group: rank 0's broadcasts in order, and the workers' join."""

    def __init__(self) -> None:
        self.items: queue.Queue[Any] = queue.Queue()
        self.joined = threading.Event()


class WireBroadcaster:
    rendezvous = RENDEZVOUS

    def __init__(self, wire: Wire):
        self.wire = wire

    def open(self) -> None:
        assert self.wire.joined.wait(20), "no worker joined: was the step announced first?"

    def send(self, header: BroadcastHeader, tensors: Any) -> None:
        self.wire.items.put(header.encode())
        self.wire.items.put([(name, t.clone()) for name, t in tensors])

    def close(self) -> None:
        pass


def engine_on(wire: Wire, monkeypatch: pytest.MonkeyPatch) -> Any:
    """tidal's NCCL engine as vLLM would hold it in a worker, its NCCL calls and vLLM's reload stubbed."""
    import vllm.model_executor.model_loader.reload as reload

    import tidal.inference.nccl_engine as module

    monkeypatch.setenv(RENDEZVOUS_ENV, json.dumps({**RENDEZVOUS, "rank_offset": 1}))
    monkeypatch.setattr(module, "receive_bytes", lambda group, device: wire.items.get(timeout=20))
    monkeypatch.setattr(module, "retie_lm_head", lambda model, config: None)
    events: list[str] = []
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: events.append("reload"))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, config: events.append("finalize"))
    engine = module.TidalNcclEngine.__new__(module.TidalNcclEngine)
    engine.model, engine.model_config, engine.device = None, None, torch.device("cpu")
    engine.model_update_group = None
    engine.weights = {}
    engine.events = events

    def join(info: Any) -> None:
        engine.joined_with = info
        engine.model_update_group = "group"
        wire.joined.set()

    def receive(
        info: Any,
    ) -> None:  # vLLM's own NCCL receive, which the engine hands the header's tensor list
        received = wire.items.get(timeout=20)
        assert [name for name, _ in received] == info.names
        engine.weights.update(dict(received))

    engine.init_transfer_engine = join
    monkeypatch.setattr(
        module.NCCLWeightTransferEngine, "receive_weights", lambda self, info, *args, **kwargs: receive(info)
    )
    return engine


class EngineClient:
    """The orchestrator's client reduced to one server whose routes call the engine, as vLLM's would."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.servers = {"http://a:8000": SimpleNamespace(url="http://a:8000", healthy=True)}
        self.loads: list[str] = []
        self.pool = self.weights = self  # InferenceClient.pool's servers, InferenceClient.weights's load_step

    async def load_step(self, path: str | Path, version: int) -> WeightUpdateReport:
        def load() -> None:
            self.engine.start_weight_update()
            self.engine.update_weights({"path": str(path)})
            self.engine.finish_weight_update()

        self.loads.append(str(path))
        await asyncio.to_thread(load)
        server = ServerVersion(url="http://a:8000", version=version, ok=True)
        return WeightUpdateReport(version=version, path=str(path), servers=(server,))


def test_trainer_orchestrator_and_server_engine_step_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = Wire()
    engine = engine_on(wire, monkeypatch)
    client = EngineClient(engine)
    model = small_model()
    publisher = NcclPublisher(tmp_path, 3, torch.bfloat16, WireBroadcaster(wire))
    sent: dict[int, dict[str, torch.Tensor]] = {}

    def trainer() -> None:
        for step in (1, 2):
            with torch.no_grad():
                model.model.norm.weight.add_(1.0)  # an "optimizer step"
            sent[step] = served(model, torch.bfloat16)
            publisher.publish(step, model, None, CPU)  # returns once the server received it

    async def orchestrator() -> None:
        watcher = PolicyWatcher(client, tmp_path, poll_interval=0.01)  # type: ignore[arg-type]
        await watcher.start()
        thread = threading.Thread(target=trainer)
        thread.start()
        try:
            await asyncio.wait_for(watcher.wait_for(1), 30)
            assert all(torch.equal(engine.weights[k], v) for k, v in sent[1].items())
            await asyncio.wait_for(watcher.wait_for(2), 30)
        finally:
            await watcher.stop()
            await asyncio.to_thread(thread.join, 30)

    asyncio.run(orchestrator())
    assert all(torch.equal(engine.weights[k], v) for k, v in sent[2].items())
    assert engine.joined_with.rank_offset == 1 and engine.joined_with.world_size == 2
    assert engine.events == ["reload", "finalize", "reload", "finalize"]
    # a server brought back into rotation replays the latest step: nothing is received, nothing torn down
    engine.start_weight_update()
    engine.update_weights({"path": client.loads[-1]})
    engine.finish_weight_update()
    assert engine.events == ["reload", "finalize", "reload", "finalize"] and wire.items.empty()


def test_a_stale_announcement_fails_the_update_before_the_model_is_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wire = Wire()
    engine = engine_on(wire, monkeypatch)
    wire.items.put(BroadcastHeader(5, ()).encode())
    engine.start_weight_update()
    with pytest.raises(ValueError, match="trainer broadcasts step 5"):
        engine.update_weights({"path": str(tmp_path / "weights" / "step_4")})
    engine.finish_weight_update()
    assert engine.events == []


def test_an_nccl_step_is_refused_while_a_server_is_out_of_rotation(tmp_path: Path) -> None:
    from tidal.transport.nccl import announce

    client = EngineClient(engine=None)
    client.servers["http://b:8001"] = SimpleNamespace(url="http://b:8001", healthy=False)
    announce(tmp_path, 1, BroadcastHeader(1, ()), RENDEZVOUS)

    async def go() -> None:
        watcher = PolicyWatcher(client, tmp_path)  # type: ignore[arg-type]
        with pytest.raises(RuntimeError, match=r"http://b:8001 is out of rotation"):
            await watcher.check_once()

    asyncio.run(go())
    assert client.loads == []  # no server was asked to wait for a broadcast that cannot complete


# ---- `tidal rl`: one setting, derived for every process -------------------------------------------------


def nccl_run(**extra: Any) -> RLConfig:
    return RLConfig.model_validate(
        {
            "model": {"dtype": "bfloat16"},
            "trainer": {"publish": {"type": "nccl", "port": 29601}},
            "deployment": {"num_replicas": 2, "inference_gpus": [0, 1, 2, 3], "trainer_gpus": [4]},
            "inference": {"vllm": {"tensor_parallel_size": 2}},
            **extra,
        }
    )


def test_split_derives_every_replicas_rendezvous_from_trainer_publish() -> None:
    roles = split_config(nccl_run(), on_gpu=True)
    publish = roles.trainer.publish
    assert isinstance(publish, NcclPublish)
    assert (publish.host, publish.port, publish.inference_world_size, publish.dtype) == (
        "127.0.0.1", 29601, 4, "bfloat16",
    )  # fmt: skip
    expected = [
        NcclRendezvous(master_address="127.0.0.1", master_port=29601, rank_offset=offset, world_size=5)
        for offset in (1, 3)  # rank 0: the trainer; then two workers (tensor parallel) per replica
    ]
    assert [r.weights.nccl for r in roles.replicas] == expected
    assert {r.weights.backend for r in roles.replicas} == {"nccl"}
    default = split_config(RLConfig(), on_gpu=False, num_cpus=2)
    assert default.inference.weights.backend == "filesystem" and default.inference.weights.nccl is None


def test_on_a_cluster_the_workers_reach_the_first_trainer_node() -> None:
    roles = split_config(nccl_run(), on_gpu=True, addresses=["10.1.0.5"])
    assert roles.trainer.publish.host == "10.1.0.5"  # type: ignore[union-attr]
    assert {r.weights.nccl.master_address for r in roles.replicas} == {"10.1.0.5"}  # type: ignore[union-attr]


def test_the_launch_starts_tidals_engine_with_the_rendezvous() -> None:
    from tidal.inference.server import build_launch

    replica = split_config(nccl_run(), on_gpu=True).replicas[1]
    launch = build_launch(replica, "m", "cuda")
    flag = launch.argv[launch.argv.index("--weight-transfer-config") + 1]
    assert json.loads(flag) == {"backend": "tidal_nccl"}
    assert json.loads(launch.env[RENDEZVOUS_ENV])["rank_offset"] == 3
    assert RENDEZVOUS_ENV not in build_launch(InferenceConfig(), "m", "cpu").env


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--inference.weights.backend", "nccl"], ["inference.weights.backend", "trainer.publish.type"]),
        (
            ["--trainer.publish.type", "nccl", "--trainer.publish.host", "h"],
            ["trainer.publish.host", "deployment"],
        ),
        (
            ["--trainer.publish.type", "nccl", "--inference.weights.check-finite", "true"],
            ["inference.weights.check_finite", "nccl"],
        ),
    ],
    ids=["backend-is-derived", "host-is-derived", "no-files-to-check"],
)
def test_settings_that_tidal_rl_derives_or_cannot_honour_are_one_line_errors(
    flags: list[str], fragments: list[str]
) -> None:
    with pytest.raises(UserError) as error:
        load_config(RLConfig, [], parse_args(flags).overrides)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and all(f in message for f in fragments), message


def test_nccl_needs_gpus_and_a_rendezvous_needs_the_nccl_backend() -> None:
    with pytest.raises(UserError, match=r"trainer.publish.type = 'nccl' needs GPUs"):
        split_config(nccl_run(), on_gpu=False, num_cpus=2)
    rendezvous = {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2}
    with pytest.raises(UserError, match=r"weights.nccl"):
        load_config(InferenceConfig, [], [("weights.nccl", rendezvous)])


def test_a_tidal_rl_server_refuses_the_sender_driven_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = engine_on(Wire(), monkeypatch)
    with pytest.raises(ValueError, match="receives `tidal rl` broadcasts"):
        engine.update_weights({"names": ["a"], "dtype_names": ["float32"], "shapes": [[1]]})
    assert engine.events == [] and engine.model_update_group is None


@pytest.mark.parametrize("tied", [True, False])
def test_a_filesystem_step_holds_what_a_full_export_holds_cast_before_it_leaves_the_weights(
    tmp_path: Path, tied: bool
) -> None:
    """The served tensors (cast where the weights live) make the same checkpoint as the gathered fp32 state
    dict cast on the CPU: every name, shape, dtype and value, the persistent buffers included."""
    from safetensors.torch import load_file

    from tidal.models.tiny import build_tokenizer
    from tidal.trainer.export import export_model

    model = small_model()
    model.config.tie_word_embeddings = tied
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 2)
    model.model.register_buffer("scale", torch.full((3,), 1.5))  # persistent: part of the checkpoint
    model.model.register_buffer("scratch", torch.zeros(2), persistent=False)
    tokenizer = build_tokenizer()
    FilesystemPublisher(tmp_path / "run", dtype=torch.bfloat16).publish(1, model, tokenizer, CPU)
    export_model(tmp_path / "export", model, tokenizer, CPU, torch.bfloat16)
    published = load_file(tmp_path / "run" / "weights" / "step_1" / "model.safetensors")
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert published.keys() == exported.keys()
    assert "model.scale" in published and "model.scratch" not in published
    assert ("lm_head.weight" in published) is not tied
    for name, tensor in exported.items():
        assert published[name].dtype == torch.bfloat16 == tensor.dtype, name
        assert torch.equal(published[name], tensor), name
    config = json.loads((tmp_path / "run" / "weights" / "step_1" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    # later steps write the config and tokenizer files made at the first one: the same files, the same bytes
    publisher = FilesystemPublisher(tmp_path / "again", dtype=torch.bfloat16)
    for step in (1, 2):
        publisher.publish(step, model, tokenizer, CPU)
    second = tmp_path / "again" / "weights" / "step_2"
    files = sorted(p.name for p in (tmp_path / "export").iterdir())
    assert sorted(p.name for p in second.iterdir()) == files
    for name in files:
        if name != "model.safetensors":
            assert (second / name).read_bytes() == (tmp_path / "export" / name).read_bytes(), name
