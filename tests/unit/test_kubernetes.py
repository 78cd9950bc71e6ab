"""Kubernetes manifests of `tidal rl` and `tidal sft` (tidal.deploy.kubernetes): valid against the API schemas
(offline, with kubernetes-validate), one pod per node of the plan, each running the node agent (`tidal node`,
`tidal sft-node`) with its own node index and every pod's address, GPUs, probes, the shared volume, the token
Secret, kubectl, and one-line config errors."""

import http.server
import json
import os
import shlex
import socket
import stat
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO
from tidal.config.loader import load_config
from tidal.config.node import SFTNodeConfig
from tidal.config.rl import RLConfig
from tidal.config.sft import SFTConfig
from tidal.deploy import kubernetes as k8s
from tidal.errors import UserError
from tidal.launcher.plan import INFERENCE, TRAINER, place
from tidal.launcher.split import split_config

RUN = REPO / "examples" / "math" / "rl.toml"
EXAMPLES = {
    "2node": REPO / "examples" / "cluster" / "k8s_2node.toml",
    "32node": REPO / "examples" / "cluster" / "k8s_32node.toml",
}
# The oldest Kubernetes with everything the manifests use (the job-completion-index pod label), and the newest
# whose schemas the package ships.
VERSIONS = ("1.28", kubernetes_validate.latest_version())


def example(name: str, *overrides: tuple[str, object]) -> RLConfig:
    return load_config(RLConfig, [str(RUN), str(EXAMPLES[name])], list(overrides))


def rendered(rl: RLConfig) -> dict[str, list[dict]]:
    return k8s.render(rl, None if rl.kubernetes.admin_token_secret else "test-token")


def jobs(files: dict[str, list[dict]]) -> dict[str, dict]:
    return {role: files[name][0] for role, name in k8s.JOB_FILES.items()}


def container(job: dict) -> dict:
    (only,) = job["spec"]["template"]["spec"]["containers"]
    return only


def assert_valid(manifest: dict) -> None:
    for version in VERSIONS:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            raise AssertionError(
                f"{manifest['kind']} {where}: {exc.message} (Kubernetes {version})"
            ) from None


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_manifest_of_the_examples_passes_the_api_schemas(name):
    files = rendered(example(name))
    kinds = [m["kind"] for manifests in files.values() for m in manifests]
    assert kinds.count("Job") == 2 and kinds.count("Service") == 2 and "ConfigMap" in kinds
    for manifests in files.values():
        for manifest in manifests:
            assert_valid(manifest)


def test_schema_validation_catches_a_broken_manifest():
    job = jobs(rendered(example("2node")))[TRAINER]
    container(job)["resources"]["limits"] = "eight GPUs"
    with pytest.raises(AssertionError, match="resources"):
        assert_valid(job)


@pytest.mark.parametrize("name", EXAMPLES)
def test_one_pod_per_node_of_the_plan_with_its_gpus(name):
    rl = example(name)
    placement = place(rl.deployment)
    by_role = jobs(rendered(rl))
    expected = {INFERENCE: placement.inference_nodes, TRAINER: placement.trainer_nodes}
    for role, job in by_role.items():
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["completions"] == spec["parallelism"] == len(expected[role])
        # a pod that finished is done: no restart, no retry of a failed rank
        assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["backoffLimit"] == 0
        gpus = rl.deployment.inference_gpus if role == INFERENCE else rl.deployment.trainer_gpus
        assert container(job)["resources"]["limits"] == {"nvidia.com/gpu": len(gpus)}
    assert sum(j["spec"]["completions"] for j in by_role.values()) == placement.num_nodes


def test_cpu_pods_request_no_gpus():
    rl = example("2node", ("kubernetes.gpu_resource", ""))
    for job in jobs(rendered(rl)).values():
        assert "limits" not in container(job).get("resources", {})
        assert_valid(job)


def _run_command(command: list[str], index: int, tmp_path: Path) -> list[str]:
    """Run a pod's command in a shell with Kubernetes' index variable set and a `tidal` that prints its argv."""
    fake = tmp_path / "bin" / "tidal"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", k8s.INDEX_ENV: str(index)}
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.parametrize("name", EXAMPLES)
def test_each_pod_runs_the_node_agent_with_its_node_index_and_every_address(name, tmp_path):
    rl = example(name)
    placement = place(rl.deployment)
    kube = rl.kubernetes
    every = k8s.addresses(rl)
    assert len(every) == placement.num_nodes and len(set(every)) == len(every)
    for role, job in jobs(rendered(rl)).items():
        pods = job["spec"]["completions"]
        for index in sorted({0, pods - 1}):
            argv = _run_command(container(job)["command"], index, tmp_path)
            assert argv[:4] == ["node", "@", "/etc/tidal/rl.toml", "--node-index"]
            assert argv[5] == "--addresses" and len(argv) == 7
            node = int(argv[4])
            assert role in placement.roles(node)
            assert argv[6].split(",") == every
            # the address of its own node is this pod's DNS name: <job>-<index>.<subdomain>.<namespace>...
            pod_spec = job["spec"]["template"]["spec"]
            own = f"{job['metadata']['name']}-{index}.{pod_spec['subdomain']}.{kube.namespace}.svc.cluster.local"
            assert every[node] == own
    assert placement.roles(len(placement.inference_nodes))[-1] == "orchestrator"  # first trainer pod


def test_headless_services_name_the_pods_subdomains_and_publish_them_before_ready():
    rl = example("32node")
    files = rendered(rl)
    services = {s["metadata"]["name"]: s for s in files[k8s.SERVICES_FILE]}
    for job in jobs(files).values():
        pod = job["spec"]["template"]
        service = services[pod["spec"]["subdomain"]]
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    trainer = services[k8s.object_name(rl.kubernetes, TRAINER)]
    assert [p["port"] for p in trainer["spec"]["ports"]] == [rl.deployment.rendezvous_port]


def _free_ports(count: int) -> int:
    """A base port with `count` consecutive ports free."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free consecutive ports")


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _serve(port: int, status: int) -> http.server.HTTPServer:
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_readiness_probe_checks_every_replica_port(tmp_path):
    base = _free_ports(2)
    rl = example(
        "2node",
        ("deployment.num_replicas", 2),
        ("deployment.inference_gpus", [0, 1]),
        ("inference.server.port", base),
    )
    inference = container(jobs(rendered(rl))[INFERENCE])
    replica_ports = [r.server.port for r in split_config(rl, True, addresses=k8s.addresses(rl)).replicas]
    assert [p["containerPort"] for p in inference["ports"]] == replica_ports == [base, base + 1]
    probe = inference["readinessProbe"]["exec"]["command"]
    probe = [sys.executable if probe[0] == "python3" else probe[0], *probe[1:]]
    assert subprocess.run(probe, capture_output=True).returncode != 0  # nothing listening yet
    first = _serve(base, 200)
    try:
        assert subprocess.run(probe, capture_output=True).returncode != 0  # the second replica is not up
        second = _serve(base + 1, 503)  # up, but answering 503 (weights broken)
        try:
            assert subprocess.run(probe, capture_output=True).returncode != 0
        finally:
            second.shutdown()
            second.server_close()
        second = _serve(base + 1, 200)
        try:
            assert subprocess.run(probe, capture_output=True).returncode == 0
        finally:
            second.shutdown()
            second.server_close()
    finally:
        first.shutdown()
        first.server_close()
    assert "readinessProbe" not in container(jobs(rendered(rl))[TRAINER])


@pytest.mark.parametrize("name", EXAMPLES)
def test_every_pod_mounts_the_shared_volume_where_output_dir_lives(name):
    rl = example(name)
    files = rendered(rl)
    mount = str(rl.kubernetes.volume.mount_path)
    run_config = tomllib.loads(files[k8s.CONFIG_FILE][0]["data"]["rl.toml"])
    assert run_config["output_dir"] == f"{mount}/{rl.output_dir.as_posix()}"
    for job in jobs(files).values():
        pod = job["spec"]["template"]["spec"]
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"]
            for v in pod["volumes"]
            if "persistentVolumeClaim" in v
        }
        mounts = {m["mountPath"]: m["name"] for m in container(job)["volumeMounts"]}
        assert claims[mounts[mount]] == (rl.kubernetes.volume.claim or f"{rl.kubernetes.name}-shared")
        config_maps = {v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v}
        assert config_maps == {f"{rl.kubernetes.name}-config"}
    assert (k8s.VOLUME_FILE in files) == (rl.kubernetes.volume.claim is None)
    if rl.kubernetes.volume.claim is None:
        assert files[k8s.VOLUME_FILE][0]["spec"]["accessModes"] == ["ReadWriteMany"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_the_config_map_holds_the_run_config_the_agents_load(name, tmp_path):
    rl = example(name)
    text = rendered(rl)[k8s.CONFIG_FILE][0]["data"]["rl.toml"]
    path = tmp_path / "rl.toml"
    path.write_text(text)
    loaded = load_config(RLConfig, [str(path)], [])
    assert loaded.output_dir == Path(k8s.pod_output_dir(rl))
    assert loaded.model_dump(exclude={"output_dir"}) == rl.model_dump(exclude={"output_dir"})


def _token_env(job: dict) -> dict:
    (env,) = [e for e in container(job)["env"] if e["name"] == "TIDAL_ADMIN_TOKEN"]
    return env["valueFrom"]["secretKeyRef"]


def test_pods_read_the_admin_token_from_the_secret():
    files = rendered(example("2node"))
    (secret,) = files[k8s.SECRET_FILE]
    for job in jobs(files).values():
        ref = _token_env(job)
        assert ref["name"] == secret["metadata"]["name"] and secret["stringData"][ref["key"]] == "test-token"
    assert "test-token" not in yaml.safe_dump(files[k8s.CONFIG_FILE])

    files = rendered(example("2node", ("kubernetes.admin_token_secret", "team-token")))
    assert k8s.SECRET_FILE not in files
    assert {_token_env(j)["name"] for j in jobs(files).values()} == {"team-token"}


def test_the_generated_secret_is_private_and_kept_across_renders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rl = example("2node")
    paths = k8s.write_manifests(rl)
    secret = k8s.manifests_dir(rl) / k8s.SECRET_FILE
    assert secret in paths and stat.S_IMODE(secret.stat().st_mode) == 0o600
    token = yaml.safe_load(secret.read_text())["stringData"]["token"]
    assert len(token) >= 32
    k8s.write_manifests(rl)
    assert yaml.safe_load(secret.read_text())["stringData"]["token"] == token
    other = example("2node", ("output_dir", "elsewhere"))
    k8s.write_manifests(other)
    assert (
        yaml.safe_load((Path("elsewhere/k8s") / k8s.SECRET_FILE).read_text())["stringData"]["token"] != token
    )

    # a later render that references an existing Secret and claim drops the files it no longer makes
    k8s.write_manifests(
        example(
            "2node",
            ("kubernetes.admin_token_secret", "t"),
            ("kubernetes.volume.size", None),
            ("kubernetes.volume.claim", "c"),
        )
    )
    assert sorted(p.name for p in k8s.manifests_dir(rl).iterdir()) == [
        "01-config.yaml",
        "03-services.yaml",
        "10-inference.yaml",
        "11-trainer.yaml",
    ]


def test_orchestrator_on_an_inference_pod_with_zmq():
    rl = example("32node", ("deployment.orchestrator_node", "inference"), ("transport.type", "zmq"))
    assert k8s.orchestrator_pod(rl) == (INFERENCE, 0)
    files = rendered(rl)
    ports = {p["name"]: p["containerPort"] for p in container(jobs(files)[INFERENCE])["ports"]}
    assert ports["rollouts"] == rl.transport.port
    assert "job-name=math-32node-inference,batch.kubernetes.io/job-completion-index=0" in k8s.follow_command(
        rl
    )
    roles = split_config(rl, True, addresses=k8s.addresses(rl))
    assert roles.trainer.transport.host == k8s.pod_address(rl.kubernetes, INFERENCE, 0)


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "over.toml"
    path.write_text(text)
    return str(path)


K8S = '[deployment]\ntype = "kubernetes"\n[kubernetes]\nimage = "i"\n[kubernetes.volume]\nclaim = "c"\n'


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[kubernetes]\nimage = "i"\n', "kubernetes"),
        ('[deployment]\ntype = "kubernetes"\n[kubernetes.volume]\nclaim = "c"\n', "kubernetes.image"),
        ('[deployment]\ntype = "kubernetes"\n[kubernetes]\nimage = "i"\n', "kubernetes.volume"),
        (K8S + 'size = "1Ti"\n', "kubernetes.volume.claim"),
        ('output_dir = "/data/run"\n' + K8S, "output_dir"),
        (K8S + '[kubernetes.trainer]\nmemory = "lots"\n', "kubernetes.trainer.memory"),
        (K8S.replace('image = "i"', 'image = "i"\nname = "Big_Run"'), "kubernetes.name"),
        (K8S + '[inference.server]\nadmin_token = "x"\n', "inference.server.admin_token"),
        (K8S.replace('type = "kubernetes"', 'type = "kubernetes"\ntrainer_gpus = [4, 5]'), "deployment.trainer_gpus"),
        (K8S + '[[kubernetes.inference.tolerations]]\noperator = "Exists"\nvalue = "v"\n',
         "kubernetes.inference.tolerations.0.value"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line_naming_the_key(tmp_path, text, key):
    with pytest.raises(UserError) as info:
        load_config(RLConfig, [_write(tmp_path, text)], [])
    message = str(info.value)
    assert "\n" not in message and f": {key}: " in message, message


def _tidal(*args: str, cwd: Path, path: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if path is not None:
        env["PATH"] = path
    return subprocess.run(
        [sys.executable, "-m", "tidal", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", EXAMPLES)
def test_dry_run_writes_manifests_that_validate(name, tmp_path):
    result = _tidal("rl", "@", str(RUN), "@", str(EXAMPLES[name]), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    listed = [tmp_path / line for line in result.stdout.splitlines() if line.endswith(".yaml")]
    folder = tmp_path / "outputs" / "math" / f"k8s_{name}" / "k8s"
    assert sorted(listed) == sorted(folder.iterdir()) and len(listed) >= 5
    assert f"kubectl apply -f {folder.relative_to(tmp_path)}" in result.stdout
    kinds = []
    for path in listed:
        for manifest in yaml.safe_load_all(path.read_text()):
            assert_valid(manifest)
            kinds.append(manifest["kind"])
    expected = {"ConfigMap", "Job", "Secret", "Service"} | (
        {"PersistentVolumeClaim"} if name == "2node" else set()
    )
    assert set(kinds) == expected


def test_the_config_error_of_a_cluster_run_is_one_line_without_traceback(tmp_path):
    result = _tidal(
        "rl", "@", str(EXAMPLES["2node"]), "--output-dir", "/elsewhere", "--dry-run", cwd=tmp_path
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and "output_dir" in result.stderr


def _kubectl(tmp_path: Path, code: int, said: str = "") -> Path:
    """A `kubectl` that records its arguments and exits with `code`, printing `said` to stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "kubectl"
    fake.write_text(
        f'#!/bin/sh\necho "$@" > {tmp_path}/kubectl.args\necho {shlex.quote(said)} >&2\nexit {code}\n'
    )
    fake.chmod(0o755)
    return bin_dir


def test_kubectl_apply_runs_only_when_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bin_dir = _kubectl(tmp_path, 0)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    assert k8s.launch(example("2node")) == 0
    assert not (tmp_path / "kubectl.args").exists()
    assert "kubectl apply -f outputs/math/k8s_2node/k8s" in capsys.readouterr().out

    assert k8s.launch(example("2node", ("kubernetes.apply", True))) == 0
    assert (tmp_path / "kubectl.args").read_text().split() == ["apply", "-f", "outputs/math/k8s_2node/k8s"]
    assert "kubectl -n default logs -f -l job-name=math-2node-trainer" in capsys.readouterr().out


def test_a_missing_or_failing_kubectl_is_one_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rl = example("2node", ("kubernetes.apply", True))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(UserError, match="kubectl is not on PATH") as info:
        k8s.launch(rl)
    assert "\n" not in str(info.value)
    monkeypatch.setenv("PATH", str(_kubectl(tmp_path, 1, "error: You must be logged in to the server\nmore")))
    with pytest.raises(UserError, match="failed: error: You must be logged in to the server$") as info:
        k8s.launch(rl)
    assert "\n" not in str(info.value)


SFT_RUN = REPO / "examples" / "reverse_text" / "sft_one_gpu.toml"
SFT_EXAMPLE = REPO / "examples" / "cluster" / "k8s_sft_2node.toml"


def sft_example(*overrides: tuple[str, object]) -> SFTConfig:
    return load_config(SFTConfig, [str(SFT_RUN), str(SFT_EXAMPLE)], list(overrides))


def test_the_sft_manifests_are_one_indexed_job_of_trainer_pods_that_pass_the_api_schemas():
    sft = sft_example()
    files = k8s.render(sft, None)
    assert sorted(files) == [k8s.VOLUME_FILE, k8s.CONFIG_FILE, k8s.SERVICES_FILE, k8s.JOB_FILES[TRAINER]]
    for manifests in files.values():
        for manifest in manifests:
            assert_valid(manifest)
    (job,) = files[k8s.JOB_FILES[TRAINER]]
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    assert spec["template"]["spec"]["restartPolicy"] == "Never" and spec["backoffLimit"] == 0
    assert container(job)["resources"]["limits"] == {"nvidia.com/gpu": 8}
    assert [e["name"] for e in container(job)["env"]] == ["PYTHONUNBUFFERED"]  # no admin token
    (service,) = files[k8s.SERVICES_FILE]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert [p["port"] for p in service["spec"]["ports"]] == [sft.deployment.rendezvous_port]
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    with pytest.raises(ValueError, match="token"):
        k8s.render(sft, "a-token")


def test_each_sft_pod_runs_tidal_sft_node_with_its_index_and_both_pod_addresses(tmp_path):
    sft = sft_example()
    (job,) = k8s.render(sft, None)[k8s.JOB_FILES[TRAINER]]
    every = k8s.addresses(sft)
    assert every == [k8s.pod_address(sft.kubernetes, TRAINER, i) for i in (0, 1)]
    for index in (0, 1):
        argv = _run_command(container(job)["command"], index, tmp_path)
        assert argv == [
            "sft-node",
            "@",
            "/etc/tidal/sft.toml",
            "--node-index",
            str(index),
            "--addresses",
            ",".join(every),
        ]


def test_the_sft_config_map_holds_the_run_config_the_pods_load(tmp_path):
    sft = sft_example()
    text = k8s.render(sft, None)[k8s.CONFIG_FILE][0]["data"]["sft.toml"]
    path = tmp_path / "sft.toml"
    path.write_text(text)
    loaded = load_config(
        SFTNodeConfig, [str(path)], [("node_index", 1), ("addresses", ",".join(k8s.addresses(sft)))]
    )
    assert loaded.output_dir == Path("/shared/outputs/reverse_text/k8s_sft_2node")
    assert loaded.model_dump(exclude={"output_dir", "node_index", "addresses", "run_id"}) == sft.model_dump(
        exclude={"output_dir"}
    )


def test_sft_dry_run_writes_manifests_that_validate(tmp_path):
    result = _tidal("sft", "@", str(SFT_RUN), "@", str(SFT_EXAMPLE), "--dry-run", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    folder = tmp_path / "outputs" / "reverse_text" / "k8s_sft_2node" / "k8s"
    listed = [tmp_path / line for line in result.stdout.splitlines() if line.endswith(".yaml")]
    assert sorted(listed) == sorted(folder.iterdir()) and len(listed) == 4
    assert f"# start the run: kubectl apply -f {folder.relative_to(tmp_path)}" in result.stdout
    kinds = []
    for path in listed:
        for manifest in yaml.safe_load_all(path.read_text()):
            assert_valid(manifest)
            kinds.append(manifest["kind"])
    assert sorted(kinds) == ["ConfigMap", "Job", "PersistentVolumeClaim", "Service"]


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ((("kubernetes.image", None),), "kubernetes.image"),
        ((("deployment.trainer_gpus", [4, 5, 6, 7, 8, 9, 10, 11]),), "deployment.trainer_gpus"),
        ((("output_dir", "/data/sft"),), "output_dir"),
    ],
)
def test_sft_config_errors_are_one_line_naming_the_key(overrides, key):
    with pytest.raises(UserError) as info:
        sft_example(*overrides)
    assert "\n" not in str(info.value) and f": {key}: " in str(info.value), info.value


def test_sft_pods_need_a_gpu_per_rank():
    with pytest.raises(UserError, match=r"deployment.trainer_gpus: lists 2 GPU\(s\) for 8 trainer rank"):
        k8s.render(sft_example(("deployment.trainer_gpus", [0, 1])), None)


def test_sft_launch_says_how_to_follow_every_trainer_pod(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{_kubectl(tmp_path, 0)}:/usr/bin:/bin")
    assert k8s.launch(sft_example(("kubernetes.apply", True))) == 0
    out = capsys.readouterr().out
    assert "tidal sft: wrote 4 manifests to outputs/reverse_text/k8s_sft_2node/k8s/" in out
    assert (
        "follow the trainer pods with: kubectl -n default logs -f -l job-name=sft-2node-trainer --prefix"
        in out
    )
