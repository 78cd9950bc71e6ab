"""Kubernetes manifests of a `tidal rl` or `tidal sft` run (`deployment.type = "kubernetes"`), rendered from
the run config into `<output_dir>/k8s/` and applied with `kubectl apply -f` on that folder (`kubernetes.apply`).

Each node of the plan (tidal.launcher.plan) is one pod, and every pod runs the node agent,
`tidal node @ rl.toml --node-index K --addresses <every pod's DNS name>`, which starts that node's roles (the
replicas of an inference node, torchrun on a trainer node, the orchestrator on the first node of its role)
and supervises them. The pods start the run by themselves; nothing is exec'd into them.

Objects, one file each, named so that `kubectl apply -f <dir>` (files in name order) creates what the pods
need before the pods:

- `00-volume.yaml`: the ReadWriteMany claim every pod mounts at `kubernetes.volume.mount_path`, where
  output_dir lives (weights, rollouts, checkpoints, logs); absent when an existing claim is named.
- `01-config.yaml`: a ConfigMap with the run config (what the user set, merged from every file and
  override, with output_dir as the pods see it), mounted at /etc/tidal/rl.toml.
- `02-secret.yaml`: the inference admin token (replicas bind every interface, so their pause and weight
  routes need it). A random token is written at render time with mode 0600 and reused by later renders of
  the same output_dir (a re-render must not change the token under running pods); with
  `kubernetes.admin_token_secret` the pods read that existing Secret instead and no file is written. Either
  way the token never enters the ConfigMap: the config refuses it in `[inference.server]` / `[orchestrator.client]`.
- `03-services.yaml`: one headless Service per role. A pod of an Indexed Job is named `<job>-<index>` and,
  with `subdomain` set to the Service, resolves as `<job>-<index>.<service>.<namespace>.svc.<domain>`:
  those names are the agents' addresses (trainer pod 0 hosts torchrun's c10d rendezvous). The Services
  publish pods before they are ready: the agents wait for health themselves, and torchrun's rendezvous must
  resolve trainer pod 0 while it starts.
- `10-inference.yaml`, `11-trainer.yaml`: one Indexed Job per role, a pod per node, each requesting its
  node's GPUs (len(deployment.inference_gpus) / trainer_gpus of `kubernetes.gpu_resource`). Inference pods
  are Ready when every replica answers /health (one exec probe checks each replica's port: a container has
  one readiness probe, and one container runs all of the node's replicas).

Why Indexed Jobs and not StatefulSets: a StatefulSet's pods always restart (restartPolicy Always), so a
trainer that finished its last step would be started again and again. A Job pod that exits 0 is done, and
Indexed Jobs give the same stable per-index hostnames through `subdomain`. Restart policy is Never with
backoffLimit 0: a rank cannot rejoin a running torchrun job, and a restarted inference replica would serve
stale weights, so one failed pod fails its Job (Kubernetes stops that Job's other pods) and the run is
restarted with `resume = true` after `kubectl delete -f <dir>` (a Job's pod template cannot be changed in
place). Finished Jobs are kept (no TTL) so their pods' logs stay readable until that delete.

How the run ends: the trainer pods and the orchestrator exit when max_steps is reached and the trainer Job
completes. Inference pods end when their agents do, i.e. when the node agent stops its replicas after the
run; until then they hold their GPUs, and `kubectl delete -f <dir>` frees them at any time.

`tidal sft` renders the same minus inference: the volume, the ConfigMap (`sft.toml`), one headless Service
and the trainer Job, whose pods run `tidal sft-node` (torchrun, joined at trainer pod 0); no Secret.
"""

import os
import secrets
import shlex
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from typing import Any

import tomli_w
import yaml

from tidal.config.deployment import DeploymentConfig
from tidal.config.inference import ADMIN_TOKEN_ENV
from tidal.config.kubernetes import KubernetesConfig, KubernetesPods, PodConfig
from tidal.config.rl import RLConfig, ZMQTransport
from tidal.errors import UserError
from tidal.launcher.plan import INFERENCE, TRAINER, ClusterRun, kind_of, place, role_nodes
from tidal.launcher.split import split_config

Manifest = dict[str, Any]

VOLUME_FILE, CONFIG_FILE, SECRET_FILE, SERVICES_FILE = (
    "00-volume.yaml", "01-config.yaml", "02-secret.yaml", "03-services.yaml",
)  # fmt: skip
JOB_FILES = {INFERENCE: "10-inference.yaml", TRAINER: "11-trainer.yaml"}
ALL_FILES = (VOLUME_FILE, CONFIG_FILE, SECRET_FILE, SERVICES_FILE, *JOB_FILES.values())

CONFIG_MOUNT = PurePosixPath("/etc/tidal")
RUN_CONFIG_KEY = "rl.toml"
"""The ConfigMap's key (and file name in the pods) of an RL run's config; SFT's is `sft.toml`."""
TOKEN_KEY = "token"
INDEX_ENV = "JOB_COMPLETION_INDEX"
"""Set by Kubernetes in every pod of an Indexed Job: the pod's index."""
GRACE_SECONDS = 300
"""Time between SIGTERM and SIGKILL: the agent stops its children in order and a signalled trainer saves a
checkpoint, which takes longer than Kubernetes' default 30 s on large models."""

# Exits non-zero unless every port answers 200 on /health (urlopen raises on any other status).
_HEALTH_PROBE = (
    "import sys, urllib.request\n"
    "for port in sys.argv[1:]:\n"
    "    urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=5)\n"
)


def manifests_dir(run: ClusterRun) -> Path:
    return run.output_dir / "k8s"


def object_name(kube: KubernetesPods, what: str) -> str:
    return f"{kube.name}-{what}"


def pod_output_dir(run: ClusterRun) -> PurePosixPath:
    """output_dir as the pods see it: a relative one is taken from the shared volume's mount path."""
    out = PurePosixPath(run.output_dir.as_posix())
    return out if out.is_absolute() else PurePosixPath(run.kubernetes.volume.mount_path.as_posix()) / out


def pod_address(kube: KubernetesPods, role: str, index: int) -> str:
    service = object_name(kube, role)
    return f"{service}-{index}.{service}.{kube.namespace}.svc.{kube.cluster_domain}"


def addresses(run: ClusterRun) -> list[str]:
    """Every pod's DNS name, by node index of the plan (inference pods first, then trainer pods)."""
    roles = kind_of(run).roles
    return [pod_address(run.kubernetes, role, i) for role in roles for i in range(role_nodes(run, role))]


def node_index_offset(run: ClusterRun, role: str) -> int:
    """The plan's index of a role's pod 0 (a pod's node index is this plus its Job index)."""
    roles = kind_of(run).roles
    return sum(role_nodes(run, earlier) for earlier in roles[: roles.index(role)])


def orchestrator_pod(rl: RLConfig) -> tuple[str, int]:
    """(role, Job index) of the pod whose agent runs the orchestrator."""
    node = place(rl.deployment).orchestrator_node
    role = INFERENCE if node < rl.deployment.num_inference_nodes else TRAINER
    return role, node - node_index_offset(rl, role)


def node_command(run: ClusterRun, role: str) -> list[str]:
    """The container command: the node agent, its node index computed by the shell from the Job index."""
    index = f"$(({node_index_offset(run, role)} + {INDEX_ENV}))"  # unquoted: the shell must expand it
    kind = kind_of(run)
    head = ["tidal", kind.agent, "@", str(CONFIG_MOUNT / kind.config_file), "--node-index"]
    tail = ["--addresses", ",".join(addresses(run))]
    script = " ".join(["exec", *map(shlex.quote, head), index, *map(shlex.quote, tail)])
    return ["/bin/sh", "-c", script]


def run_config_toml(run: ClusterRun) -> str:
    """What the user set (every file and override merged), with output_dir as the pods see it: loading it
    gives the same run config, and keys `tidal rl` fills in itself stay unset for the agents to fill."""
    data = run.model_dump(mode="json", exclude_unset=True, exclude_none=True)
    data["output_dir"] = str(pod_output_dir(run))
    return tomli_w.dumps(data)


def replica_ports(rl: RLConfig) -> list[int]:
    base = rl.inference.server.port
    return [base + i for i in range(rl.deployment.num_replicas)]


def role_ports(run: ClusterRun, role: str) -> list[tuple[str, int]]:
    """(name, port) of what a role's pods listen on, for their containers and Service."""
    ports: list[tuple[str, int]] = []
    if role == INFERENCE:
        assert isinstance(run, RLConfig)
        ports += [(f"replica-{i}", port) for i, port in enumerate(replica_ports(run))]
    elif run.deployment.num_trainer_nodes > 1:
        ports.append(("rendezvous", run.deployment.rendezvous_port))
    if (
        isinstance(run, RLConfig)
        and orchestrator_pod(run)[0] == role
        and isinstance(run.transport, ZMQTransport)
    ):
        ports.append(("rollouts", run.transport.port))
    return ports


def needs_token(run: ClusterRun) -> bool:
    """Whether the manifests create a Secret with an admin token (RL runs, unless one is named)."""
    return isinstance(run, RLConfig) and run.kubernetes.admin_token_secret is None


def render(run: ClusterRun, token: str | None) -> dict[str, list[Manifest]]:
    """Every manifest, by file name (pure). `token`: the admin token of a Secret to create; None when
    kubernetes.admin_token_secret names an existing one, and for SFT (no inference, no token).

    The split of an RL run into per-process configs is done here too, with the pods' addresses, so that a
    config the agents would refuse fails now, on this machine, and not in every pod (for SFT: a GPU per
    rank)."""
    kube = run.kubernetes
    if (token is not None) != needs_token(run):
        raise ValueError("give a token exactly when the manifests create its Secret")
    if isinstance(run, RLConfig):
        split_config(run, on_gpu=bool(kube.gpu_resource), addresses=addresses(run))
    elif kube.gpu_resource:
        run.deployment.check_trainer_gpus()
    roles = kind_of(run).roles
    files: dict[str, list[Manifest]] = {}
    if kube.volume.claim is None:
        files[VOLUME_FILE] = [_claim(kube)]
    files[CONFIG_FILE] = [_config_map(run)]
    if token is not None:
        assert isinstance(kube, KubernetesConfig)
        files[SECRET_FILE] = [_secret(kube, token)]
    files[SERVICES_FILE] = [_service(run, role) for role in roles]
    for role in roles:
        files[JOB_FILES[role]] = [_job(run, role)]
    return files


def _labels(kube: KubernetesPods, role: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "tidal", "app.kubernetes.io/instance": kube.name}
    if role is not None:
        labels["app.kubernetes.io/component"] = role
    return labels


def _metadata(kube: KubernetesPods, name: str, role: str | None = None) -> Manifest:
    return {"name": name, "namespace": kube.namespace, "labels": _labels(kube, role)}


def _claim_name(kube: KubernetesPods) -> str:
    return kube.volume.claim or object_name(kube, "shared")


def _secret_name(kube: KubernetesConfig) -> str:
    return kube.admin_token_secret or object_name(kube, "admin-token")


def _claim(kube: KubernetesPods) -> Manifest:
    assert kube.volume.size is not None  # the config requires a claim or a size
    spec: Manifest = {
        "accessModes": ["ReadWriteMany"],
        "resources": {"requests": {"storage": kube.volume.size}},
    }
    if kube.volume.storage_class is not None:
        spec["storageClassName"] = kube.volume.storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(kube, _claim_name(kube)),
        "spec": spec,
    }


def _config_map(run: ClusterRun) -> Manifest:
    kube = run.kubernetes
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(kube, object_name(kube, "config")),
        "data": {kind_of(run).config_file: run_config_toml(run)},
    }


def _secret(kube: KubernetesConfig, token: str) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(kube, _secret_name(kube)),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: token},
    }


def _service(run: ClusterRun, role: str) -> Manifest:
    kube = run.kubernetes
    spec: Manifest = {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": _labels(kube, role)}
    ports = role_ports(run, role)
    if ports:
        spec["ports"] = [{"name": n, "port": p, "targetPort": p, "protocol": "TCP"} for n, p in ports]
    return {"apiVersion": "v1", "kind": "Service", "metadata": _metadata(kube, object_name(kube, role), role),
            "spec": spec}  # fmt: skip


def _job(run: ClusterRun, role: str) -> Manifest:
    kube = run.kubernetes
    pods = role_nodes(run, role)
    name = object_name(kube, role)
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": _metadata(kube, name, role),
        "spec": {
            "completionMode": "Indexed",
            "completions": pods,
            "parallelism": pods,
            "backoffLimit": 0,
            "template": {"metadata": {"labels": _labels(kube, role)}, "spec": _pod_spec(run, role)},
        },
    }


def _pod_spec(run: ClusterRun, role: str) -> Manifest:
    kube = run.kubernetes
    if role == INFERENCE:
        assert isinstance(kube, KubernetesConfig)
        pod: PodConfig = kube.inference
    else:
        pod = kube.trainer
    spec: Manifest = {
        "subdomain": object_name(kube, role),
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": GRACE_SECONDS,
        "containers": [_container(run, role, pod)],
        "volumes": [
            {"name": "shared", "persistentVolumeClaim": {"claimName": _claim_name(kube)}},
            {"name": "config", "configMap": {"name": object_name(kube, "config")}},
            # NCCL and vLLM's workers share memory through /dev/shm; a container's default is 64 MiB
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    if kube.service_account is not None:
        spec["serviceAccountName"] = kube.service_account
    if pod.node_selector:
        spec["nodeSelector"] = dict(pod.node_selector)
    if pod.tolerations:
        spec["tolerations"] = [t.model_dump(exclude_none=True) for t in pod.tolerations]
    return spec


def _container(run: ClusterRun, role: str, pod: PodConfig) -> Manifest:
    kube = run.kubernetes
    assert kube.image is not None  # the config requires it
    env: list[Manifest] = [{"name": "PYTHONUNBUFFERED", "value": "1"}]
    if isinstance(kube, KubernetesConfig):  # RL: the replicas' admin token (SFT runs none)
        secret = {"secretKeyRef": {"name": _secret_name(kube), "key": TOKEN_KEY}}
        env.append({"name": ADMIN_TOKEN_ENV, "valueFrom": secret})
    container: Manifest = {
        "name": "tidal",
        "image": kube.image,
        "imagePullPolicy": kube.image_pull_policy,
        "command": node_command(run, role),
        "env": env,
        "volumeMounts": [
            {"name": "shared", "mountPath": kube.volume.mount_path.as_posix()},
            {"name": "config", "mountPath": str(CONFIG_MOUNT), "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    ports = role_ports(run, role)
    if ports:
        container["ports"] = [{"name": n, "containerPort": p, "protocol": "TCP"} for n, p in ports]
    resources = _resources(run, role, pod)
    if resources:
        container["resources"] = resources
    if role == INFERENCE:
        assert isinstance(run, RLConfig)
        probe_ports = [str(p) for p in replica_ports(run)]
        container["readinessProbe"] = {
            "exec": {"command": ["python3", "-c", _HEALTH_PROBE, *probe_ports]},
            "periodSeconds": 10,
            "timeoutSeconds": 5 * len(probe_ports) + 5,
            "failureThreshold": 3,
        }
    return container


def _resources(run: ClusterRun, role: str, pod: PodConfig) -> Manifest:
    """CPU and memory as requests; GPUs as limits (an extended resource's request equals its limit)."""
    resources: Manifest = {}
    requests = {key: value for key, value in (("cpu", pod.cpu), ("memory", pod.memory)) if value is not None}
    if requests:
        resources["requests"] = requests
    gpu = run.kubernetes.gpu_resource
    if gpu:
        deploy = run.deployment
        if role == INFERENCE:
            assert isinstance(deploy, DeploymentConfig)
            gpus = deploy.inference_gpus
        else:
            gpus = deploy.trainer_gpus
        resources["limits"] = {gpu: len(gpus)}
    return resources


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the run config) as YAML literal blocks, readable in the file."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def to_yaml(manifests: list[Manifest]) -> str:
    return yaml.dump_all(manifests, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def _existing_token(path: Path) -> str | None:
    """The token of a Secret this module wrote earlier at `path`, if it is readable."""
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
        token = docs[0]["stringData"][TOKEN_KEY]
    except (OSError, yaml.YAMLError, IndexError, KeyError, TypeError):
        return None
    return token if isinstance(token, str) and token else None


def write_manifests(run: ClusterRun) -> list[Path]:
    """Render into <output_dir>/k8s/ and return the files, in apply order. Files of an earlier render that
    this one does not produce (a created claim now named, a generated Secret now referenced) are removed:
    `kubectl apply -f` on the folder would apply them too."""
    out = manifests_dir(run)
    token = None
    if needs_token(run):
        token = _existing_token(out / SECRET_FILE) or secrets.token_urlsafe(32)
    files = render(run, token)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name in ALL_FILES:
            if name not in files:
                (out / name).unlink(missing_ok=True)
        paths = []
        for name, manifests in files.items():
            path = out / name
            _write(path, to_yaml(manifests), private=name == SECRET_FILE)
            paths.append(path)
    except OSError as exc:
        raise UserError(f"output_dir: cannot write the manifests into {out}: {exc.strerror or exc}") from None
    return paths


def _write(path: Path, text: str, private: bool) -> None:
    if not private:
        path.write_text(text)
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through os.open
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def follow_command(run: ClusterRun) -> str:
    """kubectl command that follows the log of the pod running the orchestrator (SFT: of every trainer
    pod, prefixed by pod: the rendezvous decides which one runs rank 0)."""
    namespace = run.kubernetes.namespace
    if not isinstance(run, RLConfig):
        job = object_name(run.kubernetes, TRAINER)
        return f"kubectl -n {namespace} logs -f -l job-name={job} --prefix --max-log-requests {run.deployment.num_trainer_nodes}"
    role, index = orchestrator_pod(run)
    job = object_name(run.kubernetes, role)
    selector = f"job-name={job},batch.kubernetes.io/job-completion-index={index}"
    return f"kubectl -n {namespace} logs -f -l {selector}"


def dry_run(run: ClusterRun) -> str:
    """`tidal rl --dry-run` / `tidal sft --dry-run`: write the manifests, list them and say how to start."""
    paths = write_manifests(run)
    lines = [str(p) for p in paths]
    lines.append(f"# start the run: kubectl apply -f {manifests_dir(run)}")
    return "\n".join(lines) + "\n"


def launch(run: ClusterRun) -> int:
    """`tidal rl` / `tidal sft`: write the manifests, then `kubectl apply` them if kubernetes.apply is set."""
    paths = write_manifests(run)
    folder = manifests_dir(run)
    prefix = f"tidal {kind_of(run).command}"
    print(f"{prefix}: wrote {len(paths)} manifests to {folder}/", flush=True)
    if not run.kubernetes.apply:
        print(f"{prefix}: start the run with: kubectl apply -f {folder}", flush=True)
        return 0
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise UserError(
            f"kubernetes.apply: kubectl is not on PATH; run `kubectl apply -f {folder}` where it is"
        )
    result = subprocess.run([kubectl, "apply", "-f", str(folder)], capture_output=True, text=True)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        said = said.splitlines()[0]
        raise UserError(f"kubernetes.apply: `kubectl apply -f {folder}` failed: {said}")
    print(result.stdout, end="", flush=True)
    what = "the orchestrator" if isinstance(run, RLConfig) else "the trainer pods"
    print(f"{prefix}: run started; follow {what} with: {follow_command(run)}", flush=True)
    return 0
