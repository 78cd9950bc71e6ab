"""The `cuda_ipc` weights backend on CPU: layout, announcement, handle, lock, the trainer's in-place buffer and
the server engine stepping together (the CUDA mapping replaced by the same CPU buffer), and where `tidal rl`
refuses it. The CUDA part runs in tests/gpu/test_cuda_ipc_gpu.py."""

import asyncio
import base64
import json
import os
import pickle
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.unit.test_publish import CPU, small_model  # the same fp32 master model and rank
from tidal.config.inference import InferenceConfig
from tidal.config.loader import load_config, parse_args
from tidal.config.rl import CudaIpcPublish, RLConfig
from tidal.errors import UserError
from tidal.launcher.restarts import max_restarts
from tidal.launcher.split import split_config
from tidal.orchestrator.policy import PolicyWatcher
from tidal.trainer.publish import CudaIpcPublisher, setup_publisher
from tidal.transport.cuda_ipc import (
    ALIGNMENT,
    Held,
    IpcAnnouncement,
    buffer_lock,
    is_buffer_announcement,
    load_handle,
    lock_path,
    plan_layout,
    read_announcement,
    slot_views,
)
from tidal.transport.nccl import TensorMeta
from tidal.transport.weights import list_published


def served(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().to(torch.bfloat16) for name, p in model.named_parameters()}


def fake_share(buffer: torch.Tensor) -> tuple[str, str]:
    return "handle", "GPU-fake"


# ---- format ---------------------------------------------------------------------------------------------


def test_layout_aligns_every_tensor_and_views_share_the_flat_buffer() -> None:
    metas = [
        TensorMeta("a", "bfloat16", (3, 5)),
        TensorMeta("b", "float32", ()),
        TensorMeta("c", "int64", (7,)),
    ]
    slots, size = plan_layout(metas)
    assert [s.offset for s in slots] == [0, ALIGNMENT, 2 * ALIGNMENT] and size == 2 * ALIGNMENT + 56
    buffer = torch.zeros(size, dtype=torch.uint8)
    views = dict(slot_views(buffer, slots))
    assert views["a"].shape == (3, 5) and views["a"].dtype == torch.bfloat16 and views["b"].shape == ()
    views["c"].fill_(-1)
    views["a"].fill_(1.5)
    assert buffer[2 * ALIGNMENT :].tolist() == [255] * 56  # written through the view, nowhere else
    assert buffer[30:ALIGNMENT].tolist() == [0] * (ALIGNMENT - 30)
    with pytest.raises(ValueError, match="unknown tensor dtype"):
        plan_layout([TensorMeta("x", "Tensor", (1,))])


def test_announcement_round_trips_and_marks_its_step(tmp_path: Path) -> None:
    from tidal.transport.cuda_ipc import announce_buffer

    slots, size = plan_layout([TensorMeta("w", "bfloat16", (2, 2))])
    announcement = IpcAnnouncement(3, "id", "GPU-1", "aGFuZGxl", size, slots)
    assert IpcAnnouncement.decode(announcement.encode()) == announcement
    path = announce_buffer(tmp_path, announcement)
    assert is_buffer_announcement(path) and read_announcement(path) == announcement
    assert list_published(tmp_path) == [(3, path)]
    with pytest.raises(ValueError, match="not a step published by"):
        read_announcement(tmp_path)


def test_the_handle_unpickler_takes_reduce_tensor_arguments_and_nothing_else() -> None:
    # what torch's reduce_tensor returns for a CUDA tensor, with placeholder bytes for the handles
    args = (torch.Tensor, torch.Size([4]), (1,), 0, torch.storage.TypedStorage, torch.bfloat16, 0, b"h", 8, 0,
            False, b"r", 0, b"e", True)  # fmt: skip
    assert load_handle(base64.b64encode(pickle.dumps(args)).decode()) == args
    evil = base64.b64encode(pickle.dumps((os.system, ("true",)))).decode()
    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        load_handle(evil)


def test_the_lock_records_what_the_buffer_holds_and_excludes_a_second_holder(tmp_path: Path) -> None:
    path = lock_path(tmp_path)
    with buffer_lock(path) as lock:
        assert lock.held() is None
        lock.record(Held("b1", 4))
        order: list[str] = []
        other = threading.Thread(target=lambda: _hold(path, order))
        other.start()
        time.sleep(0.2)
        order.append("first lets go")
    other.join(10)
    assert order == ["first lets go", "second holds step 4 of b1"]


def _hold(path: Path, order: list[str]) -> None:
    with buffer_lock(path) as lock:
        held = lock.held()
        assert held is not None
        order.append(f"second holds step {held.step} of {held.buffer_id}")


# ---- trainer → orchestrator → server engine --------------------------------------------------------------


def test_publish_casts_into_one_buffer_in_place_and_announces_the_step(tmp_path: Path) -> None:
    model = small_model()
    publisher = setup_publisher(CudaIpcPublish(), tmp_path, torch.bfloat16, info=CPU)
    assert isinstance(publisher, CudaIpcPublisher)
    publisher.share = fake_share
    publisher.publish(1, model, None, CPU)
    assert publisher.buffer is not None
    address = publisher.buffer.data_ptr()
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # an "optimizer step"
    path = publisher.publish(2, model, None, CPU)
    assert publisher.buffer.data_ptr() == address  # refreshed in place: no new buffer, no new handle
    announcement = read_announcement(path)
    assert announcement.step == 2 and announcement.handle == "handle" and announcement.gpu_uuid == "GPU-fake"
    views = dict(slot_views(publisher.buffer, announcement.slots))
    assert views.keys() == served(model).keys() and "lm_head.weight" not in views  # tied: one copy
    assert all(torch.equal(views[k], v) for k, v in served(model).items())
    with buffer_lock(lock_path(tmp_path)) as lock:
        assert lock.held() == Held(announcement.buffer_id, 2)
    assert not list(tmp_path.rglob("*.safetensors"))
    with pytest.raises(ValueError, match="LoRA"):
        setup_publisher(CudaIpcPublish(), tmp_path, None, adapter_config={"r": 8})


def test_restore_drops_announcements_of_the_buffer_that_died_with_the_trainer(tmp_path: Path) -> None:
    model = small_model()
    before = CudaIpcPublisher(tmp_path, 5, torch.bfloat16, share=fake_share)
    for step in (1, 2, 3):
        before.publish(step, model, None, CPU)
    resumed = CudaIpcPublisher(tmp_path, 5, torch.bfloat16, share=fake_share)
    resumed.restore(2, model, None, CPU)
    assert [step for step, _ in list_published(tmp_path)] == [1, 2]
    assert (
        read_announcement(tmp_path / "weights" / "step_2").buffer_id
        != read_announcement(tmp_path / "weights" / "step_1").buffer_id
    )


class FakeModel:
    """What the engine needs of a vLLM model: load_weights (copies, as vLLM's weight loaders do)."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}
        self.loads = 0

    def load_weights(self, weights: Any) -> None:
        self.loads += 1
        for name, tensor in weights:
            self.weights[name] = tensor.clone()


def engine_on(buffer_of: CudaIpcPublisher, monkeypatch: pytest.MonkeyPatch, load: str = "direct") -> Any:
    import tidal.inference.cuda_ipc_engine as module

    monkeypatch.setenv(module.LOAD_ENV, load)
    monkeypatch.setattr(module, "open_buffer", lambda handle, index: buffer_of.buffer)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="GPU-fake"))
    engine = module.TidalCudaIpcEngine.__new__(module.TidalCudaIpcEngine)
    engine.model, engine.model_config, engine.device = FakeModel(), None, torch.device("cuda", 0)
    return engine


class EngineClient:
    """The orchestrator's client reduced to one server whose routes call the engine, as vLLM's would."""

    def __init__(self, engine: Any):
        from tidal.inference.types import ServerVersion, WeightUpdateReport

        self.engine = engine
        self.recovery_timeout = 0.0
        self.servers = {"http://a:8000": SimpleNamespace(url="http://a:8000", healthy=True)}
        self.pool = self.weights = self  # InferenceClient.pool's servers, InferenceClient.weights's load_step
        self._report = lambda version, path: WeightUpdateReport(
            version=version,
            path=path,
            servers=(ServerVersion(url="http://a:8000", version=version, ok=True),),
        )

    async def load_step(self, path: str | Path, version: int) -> Any:
        def load() -> None:
            self.engine.start_weight_update()
            self.engine.update_weights({"path": str(path)})
            self.engine.finish_weight_update()

        await asyncio.to_thread(load)
        return self._report(version, str(path))


def test_trainer_orchestrator_and_server_engine_step_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = small_model()
    publisher = CudaIpcPublisher(tmp_path, 3, torch.bfloat16, share=fake_share)
    engine = engine_on(publisher, monkeypatch)
    client = EngineClient(engine)
    sent: dict[int, dict[str, torch.Tensor]] = {}

    async def run() -> None:
        watcher = PolicyWatcher(client, tmp_path, poll_interval=0.01)  # type: ignore[arg-type]
        await watcher.start()
        try:
            for step in (1, 2):
                with torch.no_grad():
                    model.model.norm.weight.add_(1.0)
                sent[step] = served(model)
                await asyncio.to_thread(publisher.publish, step, model, None, CPU)
                await asyncio.wait_for(watcher.wait_for(step), 30)
                assert all(torch.equal(engine.model.weights[k], v) for k, v in sent[step].items())
        finally:
            await watcher.stop()

    asyncio.run(run())
    assert engine.model.loads == 2
    # a server brought back into rotation replays the latest step: it holds it already, nothing loads
    engine.update_weights({"path": str(tmp_path / "weights" / "step_2")})
    assert engine.model.loads == 2


def test_a_server_behind_loads_the_newer_step_the_buffer_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = small_model()
    publisher = CudaIpcPublisher(tmp_path, 3, torch.bfloat16, share=fake_share)
    engine = engine_on(publisher, monkeypatch, load="layerwise")
    import vllm.model_executor.model_loader.reload as reload

    import tidal.inference.cuda_ipc_engine as module

    events: list[str] = []
    monkeypatch.setattr(reload, "initialize_layerwise_reload", lambda model: events.append("reload"))
    monkeypatch.setattr(reload, "finalize_layerwise_reload", lambda model, config: events.append("finalize"))
    monkeypatch.setattr(module, "retie_lm_head", lambda model, config: events.append("retie"))
    publisher.publish(1, model, None, CPU)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    publisher.publish(2, model, None, CPU)
    engine.update_weights({"path": str(tmp_path / "weights" / "step_1")})  # asked for 1, the buffer holds 2
    assert all(torch.equal(engine.model.weights[k], v) for k, v in served(model).items())
    assert events == ["reload", "finalize", "retie"]
    engine.update_weights({"path": str(tmp_path / "weights" / "step_2")})
    assert engine.model.loads == 1  # step 2 is what it loaded already


def test_a_stale_announcement_or_another_gpu_fails_before_the_model_is_touched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    publisher = CudaIpcPublisher(tmp_path, 5, torch.bfloat16, share=fake_share)
    step_2 = publisher.publish(2, small_model(), None, CPU)
    engine = engine_on(publisher, monkeypatch)
    # left behind by a trainer that died: its buffer is not the one the lock file names
    announcement = read_announcement(step_2)
    dead = IpcAnnouncement(3, "dead-buffer", "GPU-fake", "handle", announcement.size, announcement.slots)
    (tmp_path / "weights" / "step_3").mkdir()
    (tmp_path / "weights" / "step_3" / "cuda_ipc.json").write_text(dead.encode())
    with pytest.raises(ValueError, match="the announcement is stale"):
        engine.update_weights({"path": str(tmp_path / "weights" / "step_3")})
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="GPU-other"))
    with pytest.raises(ValueError, match="needs inference on trainer rank 0's GPU"):
        engine.update_weights({"path": str(step_2)})
    assert engine.model.loads == 0


# ---- `tidal rl`: where it can work, and where it cannot -------------------------------------------------


def one_gpu_run(*flags: str) -> RLConfig:
    base = ["--trainer.publish.type", "cuda_ipc", "--model.dtype", "bfloat16"]
    return load_config(RLConfig, [], parse_args([*base, *flags]).overrides)


def test_split_gives_every_replica_the_cuda_ipc_engine_and_no_restarts() -> None:
    config = one_gpu_run("--deployment.num-replicas", "2", "--deployment.inference-gpus", "[0, 0]",
                         "--inference.weights.load", "direct")  # fmt: skip
    roles = split_config(config, on_gpu=True)
    assert isinstance(roles.trainer.publish, CudaIpcPublish) and roles.trainer.publish.dtype == "bfloat16"
    assert {r.weights.backend for r in roles.replicas} == {"cuda_ipc"}
    assert max_restarts(config) == 0 and roles.orchestrator.client.recovery_timeout == 0.0
    from tidal.inference.server import build_launch

    launch = build_launch(roles.replicas[0], "m", "cuda")
    flag = launch.argv[launch.argv.index("--weight-transfer-config") + 1]
    assert json.loads(flag) == {"backend": "tidal_cuda_ipc"} and launch.env["TIDAL_CUDA_IPC_LOAD"] == "direct"
    assert launch.env["TIDAL_WEIGHTS_BACKEND"] == "cuda_ipc"  # the guard checks no files for it
    with pytest.raises(UserError, match="'cuda_ipc' shares GPU memory; use 'filesystem' on CPU"):
        split_config(config, on_gpu=False, num_cpus=2)


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--deployment.trainer-gpus", "[1]"], ["trainer.publish.type", "GPU 1", "[0]"]),
        (["--deployment.type", "slurm"], ["trainer.publish.type", "one machine"]),
        (["--inference.device", "cpu"], ["trainer.publish.type", "inference.device is 'cpu'"]),
        (["--trainer.device", "cpu"], ["trainer.publish.type", "trainer.device is 'cpu'"]),
        (
            ["--inference.vllm.tensor-parallel-size", "2", "--deployment.inference-gpus", "[0, 0]"],
            ["trainer.publish.type", "one GPU"],
        ),  # fmt: skip
        (["--trainer.lora.rank", "8"], ["trainer.publish.type", "cuda_ipc carries full weights only"]),
        (["--restarts.max-restarts", "2"], ["restarts.max_restarts", "cuda_ipc"]),
        (["--inference.weights.check-finite", "true"], ["inference.weights.check_finite", "cuda_ipc"]),
    ],
    ids=[
        "other-gpu",
        "multi-node",
        "cpu-inference",
        "cpu-trainer",
        "tensor-parallel",
        "lora",
        "restarts",
        "no-files-to-check",
    ],  # fmt: skip
)
def test_where_cuda_ipc_cannot_work_is_a_one_line_error(flags: list[str], fragments: list[str]) -> None:
    with pytest.raises(UserError) as error:
        one_gpu_run(*flags)
    message = str(error.value)
    assert len(message.splitlines()) == 1 and all(f in message for f in fragments), message


def test_direct_loading_belongs_to_cuda_ipc_and_the_server_refuses_it_on_cpu() -> None:
    with pytest.raises(UserError, match="inference.weights.load"):
        load_config(RLConfig, [], parse_args(["--inference.weights.load", "direct"]).overrides)
    with pytest.raises(UserError, match="weights.backend"):
        load_config(InferenceConfig, [], [("device", "cpu"), ("weights.backend", "cuda_ipc")])
