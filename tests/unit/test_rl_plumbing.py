"""Pure plumbing of `tidal rl`: config split, rollout transports (filesystem and ZMQ), run layout."""

import threading

from tidal import run_layout
from tidal.config.rl import FilesystemTransport, RLConfig, ZMQTransport
from tidal.launcher.split import split_config
from tidal.transport.rollouts import FilesystemReceiver, FilesystemSender, ZMQReceiver, ZMQSender
from tidal.types import MicroBatch, TrainBatch


def tiny_batch(step: int, rank: int) -> TrainBatch:
    micro = MicroBatch(
        input_ids=[[1, 2, 3]], position_ids=[[0, 1, 2]], target_ids=[[2, 3, 0]], loss_mask=[[0, 1, 0]],
        inference_logprobs=[[0.0, -0.5, 0.0]], advantages=[[0.0, 0.25 * (rank + 1), 0.0]], sample_ids=[[0, 0, 0]],
        num_samples=1,
    )  # fmt: skip
    return TrainBatch(step=step, micro_batches=[micro], num_loss_tokens_global=2, num_samples_global=2)


def test_split_copies_shared_keys_and_pins_cpu_threads(tmp_path):
    rl = RLConfig.model_validate(
        {
            "output_dir": str(tmp_path),
            "max_steps": 7,
            "seed": 3,
            "max_async_level": 2,
            "model": {"name": "some/model"},
            "deployment": {"num_trainer_ranks": 2},
            "inference": {"server": {"port": 9001}},
            "orchestrator": {"sampling": {"temperature": 0.7}},
            "transport": {"type": "zmq", "port": 6000},
        }
    )
    roles = split_config(rl, on_gpu=False, num_cpus=8)
    assert roles.orchestrator.max_steps == roles.trainer.max_steps == 7
    assert roles.orchestrator.max_async_level == 2 and roles.orchestrator.seed == roles.trainer.seed == 3
    assert roles.inference.model.name == roles.trainer.model.name == "some/model"
    assert roles.orchestrator.client.urls == ["http://127.0.0.1:9001"]
    assert roles.orchestrator.batch.num_trainer_ranks == 2
    assert roles.trainer.temperature == 0.7
    assert isinstance(roles.trainer.transport, ZMQTransport) and roles.trainer.transport.port == 6000
    assert roles.inference.cpu.omp_threads_bind == "0-3" and roles.trainer.num_threads == 2
    two_cores = split_config(rl, on_gpu=False, num_cpus=2)
    assert two_cores.inference.cpu.omp_threads_bind == "0" and two_cores.trainer.num_threads == 1


def test_filesystem_transport_is_atomic_per_step_and_prunes(tmp_path):
    sender = FilesystemSender(tmp_path, FilesystemTransport(keep_last=2))
    receivers = [
        FilesystemReceiver(tmp_path, FilesystemTransport(poll_interval=0.01), rank) for rank in range(2)
    ]
    for step in range(4):
        sender.send(step, [tiny_batch(step, 0), tiny_batch(step, 1)])
    assert [s for s, _ in run_layout.step_dirs(tmp_path / "rollouts")] == [2, 3]
    got = receivers[1].receive(3)
    assert got == tiny_batch(3, 1)
    assert receivers[0].receive(9, should_stop=lambda: True) is None
    sender.discard_from(3)
    assert [s for s, _ in run_layout.step_dirs(tmp_path / "rollouts")] == [2]


def test_zmq_transport_serves_each_rank_its_batch_even_if_asked_first():
    config = ZMQTransport(port=_free_port())
    sender = ZMQSender(config)
    receivers = [ZMQReceiver(config, rank) for rank in range(2)]
    results: dict[int, TrainBatch | None] = {}

    def fetch(rank: int) -> None:
        results[rank] = receivers[rank].receive(5)

    threads = [threading.Thread(target=fetch, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()  # the ranks ask before the batch exists
    sender.send(5, [tiny_batch(5, 0), tiny_batch(5, 1)])
    for thread in threads:
        thread.join(timeout=10)
    assert results == {0: tiny_batch(5, 0), 1: tiny_batch(5, 1)}
    for receiver in receivers:
        receiver.close()
    sender.close()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
