"""Mixture-of-experts layers as the trainer runs them: the model's router, grouped expert matmuls, the
load-balancing loss, router metrics, and the HF checkpoint names of fused expert weights.

`apply_moe` replaces the `forward` of every sparse block of a known family on the instance (parameters stay
where transformers put them, under its names) with one that calls the block's own router module (so top-k
routing is exactly the model's), runs the experts through `tidal.trainer.experts`, and hands the router's
probabilities to a `MoERouting`. The trainers use that object around each micro-batch:

    routing.start_step(num_tokens_global, gradient_scale)      # once per optimizer step
    logprobs = scorer(..., token_mask=..., routes=...)         # the scorer collects every MoE layer
    loss = task_loss + routing.aux_loss()                      # coef · share of tokens · load-balancing loss
    metrics |= routing.step_metrics(all_reduce)                # after the step

The blocks compute their statistics in every forward, also when activation checkpointing recomputes a layer
in backward (the recomputed ops must be the forward's), but only the trainer's own forward (inside
`collect`) records them. The token mask of the last forward stays set for the recomputation.

Routing replay (`moe.routing_replay`): a forward may be given the experts inference routed each token to
(`Routes`, from vLLM). Those tokens then go to the given experts instead of the router's own top-k, with
weights the router's rule computes over the given experts (softmax over all router logits, gathered at the
given experts, renormalised as the model does): the router still gets gradients, through the weights and the
load-balancing loss, while the experts that compute are inference's. How often the router's own top-k agrees
with the given routes is logged (`moe/route_agreement`).

With context parallelism (`cp_group`), each rank's forward holds a chunk of the rows, already split with its
token mask and routes (tidal.trainer.context_parallel); `aux_loss` sums the statistics over the cp group.

A family is a sparse block class plus where its router and experts live (`MoEFamily`); Qwen3-MoE is the one
so far. transformers fuses each layer's experts into 3-D tensors (`experts.gate_up_proj`,
`experts.down_proj`), while checkpoints on the hub and what vLLM loads name every expert's projections
separately: `checkpoint_tensors` splits fused tensors into those names for published weights and exports.
"""

import contextlib
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tidal.config.moe import MoEConfig
from tidal.errors import UserError
from tidal.trainer.autocast import in_autocast_dtype
from tidal.trainer.expert_parallel import expert_mlp_ep
from tidal.trainer.experts import expert_mlp, resolve_kernel


@dataclass(frozen=True)
class MoEFamily:
    """Where a sparse MoE block keeps its router and experts, and the per-expert checkpoint names."""

    block_class: str
    """Class name of the sparse block (transformers' modeling code)."""
    router: str = "gate"
    """Attribute of the router module: called on [tokens, hidden], returns (logits, top-k weights, top-k
    expert indices)."""
    experts: str = "experts"
    """Attribute of the experts module: `gate_up_proj` [experts, 2·inter, hidden], `down_proj` [experts,
    hidden, inter], `act_fn`."""
    checkpoint_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    """Checkpoint names of an expert's gate, up and down projections: `…experts.<e>.<name>.weight`."""
    norm_topk: str = "norm_topk_prob"
    """Attribute of the router module: whether the top-k weights are renormalised to sum to 1 (what
    routing replay applies to the weights of the given experts)."""


FAMILIES = {family.block_class: family for family in (MoEFamily("Qwen3MoeSparseMoeBlock"),)}


@dataclass
class LayerRouting:
    """One MoE layer's routing in one forward, padding excluded."""

    prob_sums: torch.Tensor
    """[experts] fp32: router probabilities summed over tokens (carries gradient when the loss is on)."""
    counts: torch.Tensor
    """[experts] fp32: tokens routed to each expert (a token counts once for each of its top-k)."""
    num_tokens: torch.Tensor
    """[] fp32: tokens of the forward."""


def layer_routing(
    router_logits: torch.Tensor, expert_index: torch.Tensor, mask: torch.Tensor | None, with_grad: bool
) -> LayerRouting:
    """Statistics of router_logits [tokens, experts] and expert_index [tokens, k] over mask [tokens] (1 =
    a real token; None: all), as transformers' `load_balancing_loss_func` reduces them."""
    num_experts, top_k = router_logits.shape[-1], expert_index.shape[-1]
    weights = torch.ones(router_logits.shape[0], device=router_logits.device) if mask is None else mask
    with torch.set_grad_enabled(with_grad and torch.is_grad_enabled()):
        probs = torch.softmax(router_logits.float(), dim=-1)  # [tokens, experts]
        prob_sums = (probs * weights.unsqueeze(-1)).sum(0)  # [experts]
    counts = torch.zeros(num_experts, device=router_logits.device).scatter_add(
        0, expert_index.detach().reshape(-1), weights.repeat_interleave(top_k)
    )  # [experts]
    return LayerRouting(prob_sums, counts, weights.sum())


def load_balancing_loss(layers: list[LayerRouting], num_experts: int) -> torch.Tensor:
    """transformers' load-balancing loss over `layers`: E · Σ_e f_e · P_e, with f_e the fraction of routed
    tokens and P_e the mean router probability of expert e, both over every layer's tokens together."""
    rows = torch.stack([layer.num_tokens for layer in layers]).sum().clamp(min=1)
    fraction = torch.stack([layer.counts for layer in layers]).sum(0) / rows  # [experts]
    mean_prob = torch.stack([layer.prob_sums for layer in layers]).sum(0) / rows  # [experts]
    return num_experts * (fraction * mean_prob).sum()


@dataclass
class Routes:
    """Experts inference routed tokens to, for one forward (routing replay)."""

    experts: torch.Tensor
    """[tokens, layers, k] integer: expert ids per decoder layer (the layer index of the model, dense layers
    included), in the forward's token order ([rows, seq] flattened)."""
    mask: torch.Tensor
    """[tokens] bool: which tokens have routes (the others route themselves: padding, a sample's last
    token, a rollout inference returned no routes for)."""


def replay_weights(router_logits: torch.Tensor, expert_index: torch.Tensor, normalize: bool) -> torch.Tensor:
    """The router's top-k weights for the experts `expert_index` [tokens, k] instead of its own top-k:
    softmax over router_logits [tokens, experts] in fp32, gathered at the experts, renormalised over them when
    `normalize` (as Qwen3-MoE's `norm_topk_prob`), in the logits' dtype → [tokens, k] (differentiable)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float)  # [tokens, experts]
    weights = probs.gather(1, expert_index)  # [tokens, k]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype)


def same_experts(own: torch.Tensor, given: torch.Tensor) -> torch.Tensor:
    """[tokens] bool: whether own [tokens, k] and given [tokens, k] name the same set of experts."""
    return (own.sort(dim=-1).values == given.to(own.dtype).sort(dim=-1).values).all(dim=-1)


class MoERouting:
    """Router statistics of the trainer's forwards, the load-balancing loss term, and the step's metrics."""

    def __init__(self, num_experts: int, aux_loss_coef: float, kernel: str):
        self.num_experts = num_experts
        self.aux_loss_coef = aux_loss_coef
        self.kernel = kernel
        """`grouped_mm` or `padded` (tidal.trainer.experts), resolved for this device and compute dtype."""
        self.mask: torch.Tensor | None = None
        """[tokens] fp32 of the last forward; kept for the recomputation in its backward."""
        self.ep_group: Any = None
        """With expert parallelism (`perf.ep`), the process group of this rank's `ep` ranks: the blocks then
        hold a slice of the experts and exchange tokens (tidal.trainer.expert_parallel); None: all local."""
        self.blocks: list[torch.nn.Module] = []
        """The sparse blocks `apply_moe` runs, in model order: each keeps its last training forward's
        statistics as an attribute of its own (STATS_ATTR), which `aux_loss` reads."""
        self.cp_group: Any = None
        """With context parallelism (`perf.cp`), the process group of this rank's cp group: each rank's
        forward sees a chunk of the rows, and `aux_loss` sums the statistics over the group; None: alone."""
        self.routes: Routes | None = None
        """Inference's routes of the last forward (routing replay); kept, like `mask`, for the recomputation."""
        self._collecting = False
        self._layers: list[LayerRouting] = []  # from observe() calls that name no block
        self._token_share = 0.0  # 1 / the step's tokens
        self._gradient_scale = 1.0
        self._step_counts: list[torch.Tensor] = []  # [layers, experts] per forward
        self._step_aux: list[torch.Tensor] = []  # token-weighted loss value per forward
        self._step_replay: list[torch.Tensor] = []  # [(token, layer) pairs replayed, of them agreeing]

    @contextlib.contextmanager
    def collect(self, token_mask: torch.Tensor | None, routes: Routes | None = None) -> Iterator[None]:
        """Record every MoE layer's routing during one forward; token_mask [rows, seq] (True: a real token).
        With `routes`, the tokens they cover go to inference's experts (routing replay)."""
        self.mask = None if token_mask is None else token_mask.reshape(-1).float()
        self.routes = routes
        self._clear()
        self._collecting = True
        try:
            yield
        finally:
            self._collecting = False

    def observe(
        self, router_logits: torch.Tensor, expert_index: torch.Tensor, block: torch.nn.Module | None = None
    ) -> None:
        """Called by each MoE block in every forward, recomputation included (the same ops each time).

        The statistics are kept on `block` (an attribute of the layer's own), not appended to a list here:
        under torch.compile a list's length is guarded, so every layer would compile a graph of its own."""
        mask = self.mask if self.mask is not None and self.mask.numel() == expert_index.shape[0] else None
        stats = layer_routing(router_logits, expert_index, mask, with_grad=self.aux_loss_coef > 0)
        if not self._collecting:
            return
        if block is None:
            self._layers.append(stats)
        else:
            setattr(block, STATS_ATTR, stats)

    def _clear(self) -> None:
        self._layers = []
        for block in self.blocks:
            setattr(block, STATS_ATTR, None)

    def _collected(self) -> list[LayerRouting]:
        """The statistics of the last forward, every layer's once, and forget them."""
        held = (getattr(block, STATS_ATTR, None) for block in self.blocks)
        layers = self._layers + [stats for stats in held if stats is not None]
        self._clear()
        return layers

    def route(
        self,
        layer: int,
        router_logits: torch.Tensor,
        index: torch.Tensor,
        weights: torch.Tensor,
        normalize: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts [tokens, k] and weights [tokens, k] decoder layer `layer` computes with: the router's
        own (index, weights), or inference's routes where the forward has them (their weights by the router's
        rule, `replay_weights`). Books how often the router's own top-k agrees with the routes."""
        routes = self.routes
        if routes is None:
            return index, weights
        assert routes.experts.shape[0] == index.shape[0], "routes and the forward differ in token count"
        _, num_layers, top_k = routes.experts.shape
        if layer >= num_layers or top_k != index.shape[1]:
            raise ValueError(
                f"routes hold {num_layers} layers × top-{top_k}, but decoder layer {layer} routes its tokens to "
                f"{index.shape[1]} experts: they are not this model's"
            )
        given = routes.experts[:, layer].to(index.dtype)  # [tokens, k]
        use = routes.mask.unsqueeze(-1)  # [tokens, 1]
        chosen = torch.where(use, given, index)
        if self._collecting:
            agree = same_experts(index, given) & routes.mask
            self._step_replay.append(torch.stack([routes.mask.sum(), agree.sum()]).float())
        return chosen, replay_weights(router_logits, chosen, normalize)

    def start_step(self, num_tokens_global: float, gradient_scale: float = 1.0) -> None:
        """Begin an optimizer step of `num_tokens_global` real tokens (all micro-batches of all ranks);
        `gradient_scale` multiplies the loss term as the caller multiplies its task loss (e.g. the world
        size, when FSDP averages gradients over ranks)."""
        self._token_share = 1.0 / max(1.0, num_tokens_global)
        self._gradient_scale = gradient_scale
        self._step_counts, self._step_aux, self._step_replay = [], [], []

    def aux_loss(self) -> torch.Tensor:
        """The term to add to the last forward's loss: coef × (its tokens / the step's) × load-balancing loss.
        Call once after each training forward; it also books the forward's router statistics."""
        local = self._collected()
        assert local, "aux_loss() needs a forward of the scorer in between"
        layers = local if self.cp_group is None else sum_over_group(local, self.cp_group)
        loss = load_balancing_loss(layers, self.num_experts)
        share = layers[0].num_tokens * self._token_share  # [] this forward's tokens / the step's
        # the metrics sum every rank's bookings: each rank books its own tokens' counts, and its part of a
        # loss that every rank of its cp group holds whole
        group_size = 1 if self.cp_group is None else dist.get_world_size(self.cp_group)
        self._step_counts.append(torch.stack([layer.counts for layer in local]))
        self._step_aux.append((loss * share).detach() / group_size)
        return (self.aux_loss_coef * self._gradient_scale) * share * loss

    def step_metrics(self, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        """Metrics of the step's forwards over all ranks (`all_reduce` sums a tensor over ranks)."""
        if not self._step_counts:
            return {}
        counts = torch.stack(self._step_counts).sum(0)  # [layers, experts]
        aux = torch.stack(self._step_aux).sum().reshape(1)
        # every rank sends the replay counts (zeros without routes): all_reduce needs equal shapes on all ranks
        zero = torch.zeros(2, device=counts.device)
        replay = torch.stack(self._step_replay).sum(0).to(counts.device) if self._step_replay else zero
        total = all_reduce(torch.cat([counts.flatten(), aux, replay]))
        metrics = router_metrics(total[: counts.numel()].view(counts.shape), float(total[counts.numel()]))
        return metrics | replay_metrics(float(total[-2]), float(total[-1]))


def sum_over_group(layers: list[LayerRouting], group: Any) -> list[LayerRouting]:
    """Each layer's statistics summed over the ranks of `group` (one all-reduce): the whole rows' when each
    rank's forward saw a chunk of them. The gradient flows only into this rank's own statistics: every rank
    of the group computes the same loss from the sums, so the ranks' gradients add up to the whole loss's."""
    num_experts = layers[0].counts.shape[0]
    local = torch.stack(
        [torch.cat([layer.prob_sums, layer.counts, layer.num_tokens.reshape(1)]) for layer in layers]
    )  # [layers, 2·experts + 1]
    total = local.detach().clone()
    dist.all_reduce(total, group=group)
    summed = local + (total - local.detach())  # the group's values; d summed / d local = 1
    return [LayerRouting(row[:num_experts], row[num_experts:-1].detach(), row[-1].detach()) for row in summed]


def replay_metrics(num_replayed: float, num_agreeing: float) -> dict[str, float]:
    """`moe/route_agreement`: the share of replayed (token, MoE layer) pairs whose router's own top-k is the
    set of experts inference chose; `moe/replayed`: how many such pairs there were. Nothing without replay."""
    if num_replayed <= 0:
        return {}
    return {"moe/route_agreement": num_agreeing / num_replayed, "moe/replayed": num_replayed}


def router_metrics(counts: torch.Tensor, aux_loss: float) -> dict[str, float]:
    """`moe/load_max` / `moe/load_min`: the most and least tokens any expert of any layer got, relative to
    an even split (1 = balanced); `moe/tokens_per_expert/<e>`: tokens per layer, averaged over layers."""
    per_layer_mean = counts.mean(1, keepdim=True)  # [layers, 1]
    load = counts[per_layer_mean.squeeze(1) > 0] / per_layer_mean[per_layer_mean.squeeze(1) > 0]
    metrics = {"moe/aux_loss": aux_loss}
    if load.numel():
        metrics["moe/load_max"] = float(load.max())
        metrics["moe/load_min"] = float(load.min())
    for expert, value in enumerate(counts.mean(0).tolist()):
        metrics[f"moe/tokens_per_expert/{expert}"] = value
    return metrics


def sparse_block_forward(
    block: torch.nn.Module, family: MoEFamily, routing: MoERouting, hidden_states: torch.Tensor
) -> torch.Tensor:
    """A sparse block's forward: hidden_states [batch, seq, hidden] → [batch, seq,
    hidden]."""
    batch, seq, hidden = hidden_states.shape
    # under autocast the norm before the block (fp32 master weight) hands it fp32: the block computes, and
    # returns to the residual stream, in the compute dtype
    (x,) = in_autocast_dtype(hidden_states.reshape(-1, hidden))  # [tokens, hidden]
    # the model's router: logits [tokens, experts], top-k weights and expert indices [tokens, k]
    router = getattr(block, family.router)
    router_logits, weights, expert_index = router(x)
    if routing.routes is not None:  # routing replay; the layer index is read only then (see LAYER_ATTR)
        normalize = bool(getattr(router, family.norm_topk))
        layer = getattr(block, LAYER_ATTR)
        expert_index, weights = routing.route(layer, router_logits, expert_index, weights, normalize)
    routing.observe(router_logits, expert_index, block)
    # through the experts module's call, so that FSDP2 gathers (and casts) its tensors when it is a unit
    # of its own (expert parallelism)
    out = getattr(block, family.experts)(x, expert_index, weights)  # [tokens, hidden]
    return out.view(batch, seq, hidden)


def experts_forward(
    experts: torch.nn.Module,
    routing: MoERouting,
    x: torch.Tensor,
    expert_index: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """An experts module's forward (transformers' signature): x [tokens, hidden], expert_index and weights
    [tokens, k] → [tokens, hidden], on this rank's experts (all, or its `ep` slice)."""
    module: Any = experts
    # under autocast the fp32 master tensors are cast here, inside the layer (recomputed with it under
    # activation checkpointing), as autocast does for a linear layer's weight
    gate_up, down = in_autocast_dtype(local_tensor(module.gate_up_proj), local_tensor(module.down_proj))
    act = module.act_fn
    if routing.ep_group is None:
        return expert_mlp(x, expert_index, weights, gate_up, down, act, routing.kernel)
    return expert_mlp_ep(x, expert_index, weights, gate_up, down, act, routing.kernel, routing.ep_group)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of an expert tensor sharded over `ep` (a DTensor; differentiable), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def expert_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts module of every sparse block of a known family (what `perf.ep` shards)."""
    return [getattr(block, family.experts) for block, family in find_blocks(model)]


def find_blocks(model: torch.nn.Module) -> list[tuple[torch.nn.Module, MoEFamily]]:
    """The model's sparse MoE blocks of a known family, in module order."""
    return [(m, FAMILIES[type(m).__name__]) for m in model.modules() if type(m).__name__ in FAMILIES]


def decoder_layer_index(model: torch.nn.Module, block: torch.nn.Module) -> int:
    """The index of the decoder layer holding `block` (`…layers.<i>.…` in its module name): how inference
    numbers the layers of its routes, dense layers included."""
    for name, module in model.named_modules():
        if module is block:
            parts = name.split(".")
            for before, index in zip(parts, parts[1:], strict=False):
                if before == "layers" and index.isdigit():
                    return int(index)
    raise ValueError(f"{type(block).__name__} is not inside a `layers.<i>` module of {type(model).__name__}")


def is_moe_model(model: torch.nn.Module) -> bool:
    """Whether the model's config declares experts (any family, known to tidal or not)."""
    config = getattr(model, "config", None)
    return any(
        (getattr(config, key, 0) or 0) > 0 for key in ("num_experts", "num_local_experts", "n_routed_experts")
    )


def apply_moe(
    model: torch.nn.Module, config: MoEConfig, device_type: str, compute_dtype: torch.dtype
) -> MoERouting | None:
    """Run `model`'s sparse blocks through tidal (see the module docstring); None for a model without any.

    A dense model, or an MoE family tidal does not run, with a `moe` key set is a one-line error: the
    setting would do nothing. `compute_dtype` is what the experts compute in (bf16 under mixed precision),
    which decides where `grouped_mm` runs.
    """
    blocks = find_blocks(model)
    if not blocks:
        # keys away from their defaults: `tidal rl` hands each role a config file that spells out every key,
        # defaults included, so "set" alone would flag every dense run
        set_keys = sorted(
            k for k in config.model_fields_set if getattr(config, k) != type(config).model_fields[k].default
        )
        if set_keys:
            what = (
                "an MoE family tidal does not run" if is_moe_model(model) else "no mixture-of-experts layers"
            )
            raise UserError(
                f"moe.{set_keys[0]} is set but {type(model).__name__} has {what} "
                f"(tidal runs: {', '.join(sorted(FAMILIES))}); remove it"
            )
        return None
    hf_config: Any = model.config
    coef = config.aux_loss_coef
    if coef is None:
        coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    first, family = blocks[0]
    experts = getattr(first, family.experts)
    dims = (experts.down_proj.shape[1], experts.down_proj.shape[2])  # hidden, expert intermediate
    try:
        kernel = resolve_kernel(config.experts, device_type, compute_dtype, dims)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    routing = MoERouting(int(experts.gate_up_proj.shape[0]), coef, kernel)
    routing.blocks = [block for block, _ in blocks]
    for block, family in blocks:
        setattr(block, LAYER_ATTR, decoder_layer_index(model, block))
        experts_module = getattr(block, family.experts)
        # bound methods of one shared function, not a functools.partial per module: torch.compile guards on
        # the identity of an instance's `forward`, so a partial per layer recompiled every layer
        for module, forward in ((block, _tidal_block_forward), (experts_module, _tidal_experts_forward)):
            setattr(module, ROUTING_ATTR, routing)
            module.forward = types.MethodType(forward, module)  # type: ignore[method-assign]
    return routing


ROUTING_ATTR = "_tidal_moe_routing"
"""Attribute of each sparse block and experts module run by tidal: the model's shared `MoERouting`."""
LAYER_ATTR = "_tidal_moe_layer"
"""Attribute of each sparse block: its decoder layer's index, which routing replay reads inference's routes by.
Read only while replaying: torch.compile guards on an int attribute it reads, so reading it in every forward
would compile a graph per layer (with replay on, each layer does compile its own)."""
STATS_ATTR = "_tidal_moe_stats"
"""Attribute of each sparse block: its `LayerRouting` of the training forward being collected, or None."""


def _tidal_block_forward(block: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """`forward` of a sparse block under `apply_moe` (bound to the block)."""
    family = FAMILIES[type(block).__name__]
    return sparse_block_forward(block, family, getattr(block, ROUTING_ATTR), hidden_states)


def _tidal_experts_forward(
    experts: torch.nn.Module, x: torch.Tensor, expert_index: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """`forward` of an experts module under `apply_moe` (bound to the module)."""
    return experts_forward(experts, getattr(experts, ROUTING_ATTR), x, expert_index, weights)


def fused_expert_params(model: torch.nn.Module) -> dict[str, tuple[str, MoEFamily]]:
    """Fully qualified names of fused expert tensors (`…experts.gate_up_proj` / `…experts.down_proj`) of the
    known families' blocks, with which of the two each is and its family."""
    found: dict[str, tuple[str, MoEFamily]] = {}
    for name, module in model.named_modules():
        family = FAMILIES.get(type(module).__name__)
        if family is None:
            continue
        prefix = f"{name}.{family.experts}" if name else family.experts
        for leaf in ("gate_up_proj", "down_proj"):
            found[f"{prefix}.{leaf}"] = (leaf, family)
    return found


def checkpoint_tensors(
    items: Iterable[tuple[str, torch.Tensor]], fused: dict[str, tuple[str, MoEFamily]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`items` under HF checkpoint names: each fused expert tensor named in `fused` becomes one tensor per
    expert and projection (views of it), e.g. `…experts.3.up_proj.weight` [inter, hidden]; the rest as is."""
    for name, tensor in items:
        kind = fused.get(name)
        if kind is None:
            yield name, tensor
            continue
        leaf, family = kind
        prefix = name.rpartition(".")[0]
        gate_name, up_name, down_name = family.checkpoint_projections
        if leaf == "gate_up_proj":  # [experts, 2·inter, hidden]: gate rows first, then up
            gate, up = tensor.chunk(2, dim=1)
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.{expert}.{gate_name}.weight", gate[expert]
                yield f"{prefix}.{expert}.{up_name}.weight", up[expert]
        else:  # down_proj [experts, hidden, inter]
            for expert in range(tensor.shape[0]):
                yield f"{prefix}.{expert}.{down_name}.weight", tensor[expert]
