"""Typed messages that cross process boundaries: rollouts, groups, train samples, micro-batches, batches.

Plain dataclasses of Python lists and numbers, so they pickle, JSON-encode and survive
`torch.load(weights_only=True)` through `to_dict`/`from_dict`. torch is imported lazily (only by
`MicroBatch.to_tensors`) so the orchestrator and the config stay light.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

PAD_MULTIPLE = 16
"""Default of the packers' `pad_multiple` (SFT's data.pad_multiple, RL's orchestrator.batch.pad_multiple)."""


def padded_width(longest: int, seq_len: int, multiple: int) -> int:
    """The width of a micro-batch whose longest row holds `longest` tokens: rounded up to a multiple of
    `multiple`, never wider than `seq_len`, at least one token (a micro-batch of padding only still runs).

    Rows are padded to this rather than to `seq_len` so that the forward pass costs what the real tokens
    cost; `multiple` bounds how many distinct shapes compiled kernels meet (`multiple` = `seq_len`: one).
    """
    rounded = -(-max(1, longest) // multiple) * multiple
    return min(seq_len, rounded)


@dataclass(frozen=True)
class RoutedExperts:
    """The experts an MoE model routed tokens to in inference: [tokens, layers, k] unsigned integers (the
    layers are the model's decoder layers, dense ones included), kept compact as base64 of the raw C-order
    little-endian array, so messages stay JSON (routing replay, `moe.routing_replay`)."""

    data: str
    """base64 of the [tokens, layers, k] array's bytes."""
    num_layers: int
    top_k: int
    itemsize: int = 1
    """Bytes per expert id: 1 (up to 256 experts), 2 (up to 65,536)."""

    @property
    def token_bytes(self) -> int:
        return self.num_layers * self.top_k * self.itemsize

    @property
    def num_tokens(self) -> int:
        return len(self.raw()) // self.token_bytes

    def raw(self) -> bytes:
        return base64.b64decode(self.data)

    @classmethod
    def from_raw(cls, raw: bytes, num_layers: int, top_k: int, itemsize: int) -> RoutedExperts:
        if (
            num_layers < 1
            or top_k < 1
            or itemsize not in (1, 2)
            or len(raw) % (num_layers * top_k * itemsize)
        ):
            raise ValueError(
                f"routed experts: {len(raw)} bytes do not hold whole tokens of {num_layers} layers x {top_k} "
                f"experts x {itemsize} byte(s)"
            )
        return cls(base64.b64encode(raw).decode("ascii"), num_layers, top_k, itemsize)

    def same_shape(self, other: RoutedExperts) -> bool:
        return (self.num_layers, self.top_k, self.itemsize) == (other.num_layers, other.top_k, other.itemsize)

    def to_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """[tokens, layers, k] int64 (what the trainer indexes experts with)."""
        import numpy as np
        import torch

        array = np.frombuffer(self.raw(), dtype="<u1" if self.itemsize == 1 else "<u2")
        return torch.from_numpy(array.astype(np.int64)).view(-1, self.num_layers, self.top_k).to(device)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RoutedExperts | None:
        return None if data is None else cls(**data)


_ARRAY_DTYPES = {"float32": "<f4", "int64": "<i8", "bool": "|b1"}
"""The element types a PackedArray carries, by name: numpy's little-endian codes."""


def _array_bytes(array: Any, dtype: str) -> bytes:
    """`array`'s C-order little-endian bytes as a PackedArray of `dtype` carries them."""
    import numpy as np

    return np.ascontiguousarray(array, dtype=_ARRAY_DTYPES[dtype]).tobytes()


class PackedArray:
    """A numeric array as JSON: base64 of its C-order little-endian bytes, its shape and its dtype's name
    (`float32`, `int64` or `bool`). What a model's vision inputs travel as (`Pictures`).

    The array itself is kept beside the text once made or decoded (JSON and equality see the values alone)
    and goes along when pickled: decoding base64 ran at ~0.1 s per SmolVLM picture, in the trainer's step,
    for every micro-batch it was in. `text_free` makes a copy without the text, whose array crosses to
    another process through shared memory; its text is made only if asked for (`data`, `to_json`)."""

    __slots__ = ("_text", "shape", "dtype", "_array")

    def __init__(self, data: str | None, shape: Sequence[int], dtype: str, array: Any = None):
        if dtype not in _ARRAY_DTYPES:
            raise ValueError(f"packed arrays hold {', '.join(_ARRAY_DTYPES)}, not {dtype}")
        if data is None and array is None:
            raise ValueError("a packed array needs its text or its array")
        self._text = data
        self.shape = [int(n) for n in shape]
        self.dtype = dtype
        self._array = array  # a numpy array, or a torch tensor in shared memory (`text_free`)

    @classmethod
    def from_numpy(cls, array: Any) -> PackedArray:
        import numpy as np

        name = str(array.dtype)
        if name not in _ARRAY_DTYPES:
            raise ValueError(f"packed arrays hold {', '.join(_ARRAY_DTYPES)}, not {name}")
        raw = _array_bytes(array, name)
        kept = np.frombuffer(raw, dtype=_ARRAY_DTYPES[name]).reshape(array.shape)
        return cls(base64.b64encode(raw).decode("ascii"), array.shape, name, kept)

    @property
    def data(self) -> str:
        """The base64 text (made from the array the first time, for a `text_free` copy)."""
        if self._text is None:
            self._text = base64.b64encode(_array_bytes(self.to_numpy(), self.dtype)).decode("ascii")
        return self._text

    def to_json(self) -> dict[str, Any]:
        return {"data": self.data, "shape": self.shape, "dtype": self.dtype}

    def to_numpy(self) -> Any:
        """The array (read-only: it is shared by every caller)."""
        import numpy as np

        kept = self._array
        if kept is None:
            flat = np.frombuffer(base64.b64decode(self._text or ""), dtype=_ARRAY_DTYPES[self.dtype])
            kept = self._array = flat.reshape(self.shape)
        elif not isinstance(kept, np.ndarray):  # a shared-memory tensor: its numpy view from now on
            kept = kept.numpy()
            kept.flags.writeable = False
            self._array = kept
        return kept

    def text_free(self) -> PackedArray:
        """A copy without the text whose array, pickled, goes through shared memory (torch's reduction for
        tensors): one process hands another a SmolVLM picture's 16 MB of tiles without piping it, nor its
        21 MB of base64, which held the receiving trainer's GIL ~1 s a step (benchmarks/picture_prep.py)."""
        import torch

        dtype = {"float32": torch.float32, "int64": torch.int64, "bool": torch.bool}[self.dtype]
        shared = torch.empty(self.shape, dtype=dtype).share_memory_()
        shared.numpy()[...] = self.to_numpy()
        return PackedArray(None, self.shape, self.dtype, shared)

    def __getstate__(self) -> tuple[Any, ...]:
        return self._text, self.shape, self.dtype, self._array

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self._text, self.shape, self.dtype, self._array = state

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PackedArray):
            return NotImplemented
        if (self.shape, self.dtype) != (other.shape, other.dtype):
            return False
        if self._text is not None and other._text is not None:
            return self._text == other._text
        import numpy as np

        return bool(np.array_equal(self.to_numpy(), other.to_numpy()))

    __hash__ = None  # type: ignore[assignment]  # mutable caches; compared by value

    def __repr__(self) -> str:
        return f"PackedArray(shape={self.shape}, dtype={self.dtype!r})"

    @classmethod
    def concat(cls, arrays: list[PackedArray]) -> PackedArray:
        """The arrays joined along their first dimension (their other dimensions and dtypes must agree)."""
        first = arrays[0]
        if any(a.dtype != first.dtype or a.shape[1:] != first.shape[1:] for a in arrays):
            raise ValueError(
                "packed arrays to join differ in dtype or trailing shape: "
                + ", ".join(f"{a.dtype}{a.shape}" for a in arrays)
            )
        import numpy as np

        return cls.from_numpy(np.concatenate([a.to_numpy() for a in arrays]))


@dataclass(frozen=True)
class Pictures:
    """The pictures of a sample (or of a micro-batch's samples, in the order of their image tokens) as the
    model's vision tower takes them, made by the model's own processor (tidal.models.vision). Each array's
    first dimension runs over the pictures' parts in order: Idefics3 / SmolVLM tiles for `pixel_values`
    [tiles, 3, H, W] and `pixel_attention_mask` [tiles, H, W]; Qwen2-VL-style patches for `pixel_values`
    [patches, C·T·P·P] with `image_grid_thw` [pictures, 3]."""

    count: int
    """How many pictures."""
    pixel_values: PackedArray
    pixel_attention_mask: PackedArray | None = None
    image_grid_thw: PackedArray | None = None

    def arrays(self) -> dict[str, PackedArray]:
        """The model inputs present, by their forward argument's name."""
        named = {
            "pixel_values": self.pixel_values,
            "pixel_attention_mask": self.pixel_attention_mask,
            "image_grid_thw": self.image_grid_thw,
        }
        return {name: array for name, array in named.items() if array is not None}

    @classmethod
    def concat(cls, parts: list[Pictures]) -> Pictures | None:
        """The pictures of several samples, in order, as one; None for none."""
        if not parts:
            return None
        names = _input_names(parts)
        joined = {name: PackedArray.concat([p.arrays()[name] for p in parts]) for name in names}
        return cls(count=sum(p.count for p in parts), **joined)

    def tensors(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The model inputs as tensors on `device` (float32, int64, bool), by argument name."""
        return Pictures.join_tensors([self], device)

    @staticmethod
    def join_tensors(
        parts: Sequence[Pictures], device: torch.device | str = "cpu", once: bool = False
    ) -> dict[str, torch.Tensor]:
        """The model inputs of several samples' pictures, in order, as one tensor per argument name on
        `device`; {} for none. Joined here, where the model runs, rather than re-encoded where batches are
        packed (the orchestrator's event loop).

        `once`: parts that are one object (a group's samples share their prompt's pictures) are joined once,
        and `REPEAT + name` holds, for each input that repeats, the index that spreads its rows back into
        `parts`' order (tidal.trainer.chunked runs the vision tower once per picture with it)."""
        if not parts:
            return {}
        import numpy as np
        import torch

        names = _input_names(parts)
        decoded: dict[int, dict[str, Any]] = {}  # samples sharing one Pictures object decode it once
        for part in parts:
            if id(part) not in decoded:
                decoded[id(part)] = {name: array.to_numpy() for name, array in part.arrays().items()}
        joined_parts = list(decoded.values()) if once else [decoded[id(p)] for p in parts]
        joined = {name: np.concatenate([d[name] for d in joined_parts]) for name in names}
        out = {name: torch.from_numpy(array).to(device) for name, array in joined.items()}
        if once and len(decoded) < len(parts):
            for name in names:
                out[REPEAT + name] = _repeat_index(parts, decoded, name).to(device)
        return out

    def to_dict(self) -> dict[str, Any]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v.to_json() if isinstance(v, PackedArray) else v for k, v in values.items()}

    def text_free(self) -> Pictures:
        """The same pictures without their arrays' text, to hand to another process (`PackedArray.text_free`)."""
        arrays = {name: array.text_free() for name, array in self.arrays().items()}
        return Pictures(self.count, **arrays)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Pictures | None:
        return None if data is None else cls.from_json(data)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Pictures:

        def array(name: str) -> PackedArray | None:
            value = data.get(name)
            return None if value is None else PackedArray(**value)

        values = array("pixel_values")
        if values is None:
            raise ValueError("pictures without pixel_values")
        return cls(data["count"], values, array("pixel_attention_mask"), array("image_grid_thw"))


REPEAT = "repeat/"
"""The prefix of `Pictures.join_tensors(once=True)`'s index entries (not model inputs)."""


def _repeat_index(parts: Sequence[Pictures], decoded: dict[int, dict[str, Any]], name: str) -> Any:
    """For input `name`, the row of the once-joined tensor behind each row of `parts` joined in order."""
    import torch

    start, offset = {}, 0
    for key, arrays in decoded.items():  # the once-joined order: first appearance
        start[key] = offset
        offset += len(arrays[name])
    spans = [torch.arange(len(decoded[id(p)][name])) + start[id(p)] for p in parts]
    return torch.cat(spans)


def _input_names(parts: Sequence[Pictures]) -> set[str]:
    """The model inputs every one of `parts` carries (they must carry the same ones to be joined)."""
    names = set(parts[0].arrays())
    if any(set(p.arrays()) != names for p in parts):
        raise ValueError("the samples' pictures carry different model inputs")
    return names


@dataclass
class Rollout:
    """One completion for one task, as generated by inference and scored by the environment.

    `completion_logprobs[i]` is the inference engine's sampling logprob of `completion_ids[i]`;
    `completion_mask[i]` is 1 for model-generated tokens to train on and 0 for tokens the environment
    inserted (tool results, user turns of a multi-turn episode). `policy_version` is the oldest weight
    version that produced any token (what the staleness bound checks), `policy_version_max` the newest.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    completion_mask: list[int]
    reward: float
    policy_version: int
    policy_version_max: int
    env: str
    task_id: str
    metrics: dict[str, float] = field(default_factory=dict)
    failed: bool = False
    rollout_id: str = ""
    """`<task position>/<index in its group>` (tidal.rollout.sampler.rollout_id): one rollout has one
    id however often its step is made again."""
    routed_experts: RoutedExperts | None = None
    """With routing replay: the experts inference routed the first tokens of prompt + completion to (all but
    the last token, which inference never ran through the model); None: none recorded."""
    images: list[str] = field(default_factory=list)
    """The prompt's pictures in order (data URLs), one per image placeholder in `prompt_ids`, which holds
    the placeholders as the chat template wrote them; the trainer's ids expand them (`TrainSample`)."""
    policy_versions: list[int] = field(default_factory=list)
    """The weight version behind each model call of the episode, in order (one per turn; an in-flight
    update within a call counts its older version): its age at every turn. `policy_version` is their
    minimum, `policy_version_max` their maximum."""
    teacher_logprobs: list[float] = field(default_factory=list)
    """On-policy distillation: the teacher's logprob of each completion token given what precedes it (the
    same positions as `completion_logprobs`); empty where no teacher was asked."""

    def __post_init__(self) -> None:
        num = len(self.completion_ids)
        if len(self.completion_logprobs) != num or len(self.completion_mask) != num:
            raise ValueError(
                f"rollout {self.task_id!r}: {num} completion ids but {len(self.completion_logprobs)} logprobs "
                f"and {len(self.completion_mask)} mask entries"
            )
        if self.teacher_logprobs and len(self.teacher_logprobs) != num:
            raise ValueError(
                f"rollout {self.task_id!r}: {num} completion ids but {len(self.teacher_logprobs)} teacher logprobs"
            )
        if self.policy_version_max < self.policy_version:
            raise ValueError(
                f"rollout {self.task_id!r}: policy_version_max {self.policy_version_max} "
                f"< policy_version {self.policy_version}"
            )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, the token lists themselves (not `asdict`'s deep copies: the orchestrator's state holds
        every group that ended ahead of its step, saved on its event loop at every step)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["metrics"] = dict(self.metrics)
        out["routed_experts"] = None if self.routed_experts is None else asdict(self.routed_experts)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Rollout:
        return cls(**{**data, "routed_experts": RoutedExperts.from_dict(data.get("routed_experts"))})


@dataclass
class Group:
    """The `group_size` rollouts of one task; advantages are computed within a group."""

    task_id: str
    env: str
    rollouts: list[Rollout]

    def to_dict(self) -> dict[str, Any]:
        return {"task_id": self.task_id, "env": self.env, "rollouts": [r.to_dict() for r in self.rollouts]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Group:
        rollouts = [Rollout.from_dict(r) for r in data["rollouts"]]
        return cls(task_id=data["task_id"], env=data["env"], rollouts=rollouts)


@dataclass
class TrainSample:
    """One rollout ready for training; every list is aligned with `input_ids` (prompt + completion).

    `loss_mask[i]` and `inference_logprobs[i]` describe token i (0 and 0.0 on the prompt): the logprob is
    that of token i given tokens < i, so it is compared with the trainer's prediction at position i − 1.
    """

    input_ids: list[int]
    loss_mask: list[int]
    inference_logprobs: list[float]
    advantage: float
    policy_version: int
    rollout_id: str = ""
    """The rollout it was made from."""
    routed_experts: RoutedExperts | None = None
    """Inference's experts for the first tokens of `input_ids` (routing replay); None: the trainer routes."""
    pictures: Pictures | None = None
    """The prompt's pictures as the vision tower takes them; `input_ids` then holds each picture's image
    tokens expanded as vLLM expanded them. None: a text sample."""
    token_advantages: list[float] | None = None
    """Each token's own advantage, aligned with `input_ids` (on-policy distillation); None: `advantage` on
    every token."""

    def __len__(self) -> int:
        return len(self.input_ids)


@dataclass
class PictureTable:
    """Pictures as they go out: each distinct Pictures object once, in `sent`; `index` gives its place."""

    sent: list[dict[str, Any]] = field(default_factory=list)
    _index_of: dict[int, int] = field(default_factory=dict)
    _held: list[Pictures] = field(default_factory=list)  # alive while indexed by id

    def index(self, pictures: Pictures) -> int:
        if id(pictures) not in self._index_of:
            self._index_of[id(pictures)] = len(self.sent)
            self.sent.append(pictures.to_dict())
            self._held.append(pictures)
        return self._index_of[id(pictures)]


@dataclass
class MicroBatch:
    """Packed rows for one forward pass; every field is a `[rows][width]` nested list, where width is the
    longest row's length rounded up (`padded_width`), at most the batch's seq_len.

    Several samples share a row; `position_ids` restart at 0 for each (that is what keeps attention inside
    a sample) and padding continues the last sample's positions (see `trainer/data.py: pad_row`).
    Position i predicts `target_ids[i]`, the next token of the same sample; `loss_mask`,
    `inference_logprobs` and `advantages` describe that target (0 where it does not exist: a sample's last
    token and padding). `sample_ids` numbers the samples of this micro-batch 0..num_samples-1 (−1 on
    padding) for sequence-level ratios and per-sequence normalisation.
    """

    input_ids: list[list[int]]
    position_ids: list[list[int]]
    target_ids: list[list[int]]
    loss_mask: list[list[int]]
    inference_logprobs: list[list[float]]
    advantages: list[list[float]]
    sample_ids: list[list[int]]
    num_samples: int
    rollout_ids: list[str] = field(default_factory=list)
    """The rollout of each sample, by sample id: what the trainer trained, for checks across steps."""
    routed_experts: RoutedExperts | None = None
    """Routing replay: inference's experts for every position, [rows · width] tokens in row order (zeros
    where `routed_mask` is 0); None: no sample of the micro-batch has routes."""
    routed_mask: list[list[int]] = field(default_factory=list)
    """[rows][width]: 1 where `routed_experts` holds a route (empty when it is None)."""
    pictures: list[Pictures] = field(default_factory=list)
    """The pictures of each sample that has some, rows in order and samples in row order: the order of their
    image tokens in the flattened rows, which is the order the model puts picture features in. Empty: text.
    Kept per sample (the trainer joins them, `picture_tensors`), so packing never decodes them."""

    @property
    def num_loss_tokens(self) -> int:
        return sum(sum(row) for row in self.loss_mask)

    def to_dict(self, table: PictureTable | None = None) -> dict[str, Any]:
        """The fields as JSON-ready values, the token lists themselves (not copies: `asdict` deep-copied
        every element, 0.4 s of the orchestrator's event loop for a 256-sample step). The pictures go into
        `table` when given (the batch's, shared by its micro-batches; `pictures` is then None), else here."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["routed_experts"] = None if self.routed_experts is None else asdict(self.routed_experts)
        # a group's samples share one prompt's Pictures object (orchestrator.batching): each goes out once,
        # and `picture_order` says which one every sample has
        mine = table if table is not None else PictureTable()
        out["picture_order"] = [mine.index(pictures) for pictures in self.pictures]
        out["pictures"] = None if table is not None else mine.sent
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], shared: list[Pictures] | None = None) -> MicroBatch:
        """From `to_dict`'s values; `shared`: the batch's pictures, where `pictures` is None."""
        fields_ = dict(data)
        own = fields_.pop("pictures", None)
        sent = [Pictures.from_json(p) for p in own] if own is not None else (shared or [])
        order = fields_.pop("picture_order", None)
        pictures = sent if order is None else [sent[index] for index in order]
        return cls(
            **{
                **fields_,
                "routed_experts": RoutedExperts.from_dict(data.get("routed_experts")),
                "pictures": pictures,
            }
        )

    def picture_tensors(
        self, device: torch.device | str = "cpu", once: bool = False
    ) -> dict[str, torch.Tensor]:
        """The pictures' model inputs as tensors on `device` (float32, int64, bool), by argument name; {}
        for text. `once`: shared pictures joined once, with their repeat indices (`Pictures.join_tensors`)."""
        return Pictures.join_tensors(self.pictures, device, once)

    def routes_tensors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor] | None:
        """(experts [rows · seq, layers, k] int64, mask [rows · seq] bool) for routing replay; None without."""
        if self.routed_experts is None:
            return None
        import torch

        mask = torch.tensor(self.routed_mask, dtype=torch.bool, device=device).reshape(-1)
        return self.routed_experts.to_tensor(device), mask

    def to_tensors(self, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
        """The fields as tensors on `device`, every one of shape [rows, width]."""
        import torch

        def as_tensor(value: list[list[Any]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(value, dtype=dtype, device=device)

        return {
            "input_ids": as_tensor(self.input_ids, torch.long),  # [rows, seq]
            "position_ids": as_tensor(self.position_ids, torch.long),  # [rows, seq]
            "target_ids": as_tensor(self.target_ids, torch.long),  # [rows, seq]
            "loss_mask": as_tensor(self.loss_mask, torch.bool),  # [rows, seq]
            "inference_logprobs": as_tensor(self.inference_logprobs, torch.float32),  # [rows, seq]
            "advantages": as_tensor(self.advantages, torch.float32),  # [rows, seq]
            "sample_ids": as_tensor(self.sample_ids, torch.long),  # [rows, seq]
        }


@dataclass
class TrainBatch:
    """What one trainer rank consumes for optimizer step `step`.

    The normalisers are global (over every rank's micro-batches) because the loss is summed over
    micro-batches and ranks; see `trainer/loss.py: rl_loss`. `num_trainer_ranks` is how many ranks the
    orchestrator split the step into: a trainer of another world size would drop or miss data.
    """

    step: int
    micro_batches: list[MicroBatch]
    num_loss_tokens_global: int
    num_samples_global: int
    metrics: dict[str, float] = field(default_factory=dict)
    num_trainer_ranks: int = 1
    cp: int = 1
    """Trainer ranks per context-parallel group: the batch of rank r is that of every rank r' with
    r' // cp == r // cp (they split its rows along the sequence)."""

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        # a group's samples land in several micro-batches: their pictures go out once for the whole batch
        table = PictureTable()
        out["micro_batches"] = [m.to_dict(table) for m in self.micro_batches]
        out["pictures"] = table.sent
        out["metrics"] = dict(self.metrics)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainBatch:
        shared = [Pictures.from_json(p) for p in data.get("pictures") or []]
        return cls(
            step=data["step"],
            micro_batches=[MicroBatch.from_dict(m, shared) for m in data["micro_batches"]],
            num_loss_tokens_global=data["num_loss_tokens_global"],
            num_samples_global=data["num_samples_global"],
            metrics=dict(data["metrics"]),
            num_trainer_ranks=data["num_trainer_ranks"],
            cp=data.get("cp", 1),
        )
