"""MoE training: the load-balancing losses, DeepSeek-V3's aux-loss-free expert-bias update, the MTP loss, and the
per-step expert-load statistics. Megatron-Core's formulas (transformer/moe/router.py, moe_utils.py, multi_token_
prediction.py); the model in train/model.py stays plain and is hooked from outside (`Router.on_route`).

Losses that only shape gradients are added through the backward pass (Megatron's MoEAuxLossAutoScaler): the logged
language-model loss stays the cross-entropy, and each auxiliary loss gets the gradient `backward_scale` (the main
loss's per-micro-batch scale, 1/num_micro) in the backward pass.

    aux_loss       E * sum_i f_i * P_i over the micro-batch's tokens: f_i the fraction of the top-k slots routed to
                   expert i, P_i the mean router probability of i (softmax scores; sigmoid scores normalised per
                   token); the routing map for f is the plain top-k of those scores (no bias, no group limit). The
                   counts are summed over the ranks that split a sequence (context parallel), as Megatron's tp_cp
                   group does.
    seq_aux_loss   the same per sequence, averaged over the sequences of the micro-batch (DeepSeek-V3).
    expert bias    after each step: bias += rate * sign(mean load - load), with the tokens each expert received
                   (the actual routing) summed over the step's micro-batches and all data-parallel ranks.
    MTP            depth d (1-based) predicts labels shifted by d; its mean cross-entropy over the positions that
                   still have a label, times mtp_loss_scaling_factor / mtp_num_layers, is added. The shift is
                   megatron-core's roll_tensor (shift -1 with zero fill, once per depth) applied to the input ids,
                   the labels and the loss mask: over the whole sequence, or within each document when attention
                   is per document (--reset-attention-mask: megatron-core's packed_seq_params path, the last d
                   tokens of every document masked). Under context parallelism the shift is taken on the whole
                   micro-batch, which every CP rank holds, then split zigzag: the token beyond a chunk's end is what
                   megatron-core's p2p exchange brings from the neighbouring CP rank (or 0 at the sequence's end).
                   The mean divides by the depth's unmasked tokens of the whole micro-batch (all CP ranks), as the
                   language-model loss does; megatron-core divides each CP rank's sum by that rank's own count
                   (rank 0 holds the masked tail), which would make the loss depend on the CP size.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from checkpoint.config import ModelConfig
from checkpoint.errors import ConfigError
from train.parallel.expert import expert_counts

LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
ROUTER_DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


@dataclass(frozen=True)
class MoESettings:
    """What the flags chose, resolved (defaults are Megatron's; `setup` puts the checkpoint's coefficient in
    aux_loss_coeff when --moe-aux-loss-coeff is not given)."""

    load_balancing_type: str = "aux_loss"
    aux_loss_coeff: float = 0.0
    bias_update_rate: float = 1e-3
    mtp_loss_scaling_factor: float = 0.1
    router_dtype: str | None = None


# -- the formulas (pure) -----------------------------------------------------------------------------------------------

def aux_loss_scores(scores: Tensor, score_function: str, topk: int) -> tuple[Tensor, Tensor]:
    """(probabilities [T, E], routing map [T, E] bool) the load-balancing loss is computed on (Megatron's
    compute_routing_scores_for_aux_loss): softmax scores as they are, sigmoid scores normalised per token; the map
    is their plain top-k."""
    probs = scores.float()
    if score_function == "sigmoid":
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    top = torch.topk(probs, topk, dim=-1)[1]
    return probs, torch.zeros_like(probs, dtype=torch.bool).scatter_(1, top, True)


def switch_aux_loss(probs: Tensor, tokens_per_expert: Tensor, total_tokens: int, topk: int, coeff: float) -> Tensor:
    """coeff * E * sum_i f_i P_i with f_i = tokens_i / (k T) and P_i = sum_t probs[t, i] / T (T = total_tokens, the
    tokens of every rank that contributed to tokens_per_expert; probs may be this rank's share of them)."""
    E = probs.shape[-1]
    return (probs.sum(0) * tokens_per_expert.to(probs.dtype)).sum() * (E * coeff / (topk * total_tokens ** 2))


def load_balancing_loss(kind: str, probs: Tensor, routing_map: Tensor, batch: int, topk: int, coeff: float,
                        group=None) -> Tensor:
    """The aux loss of one micro-batch's router output (probs, routing_map [b*s, E], batch-major tokens). `group`:
    the ranks holding the other parts of these sequences (their counts are summed, their tokens counted)."""
    n = 1 if group is None else dist.get_world_size(group)
    E = probs.shape[-1]
    if kind == "aux_loss":
        counts = routing_map.sum(0)
        if n > 1:
            dist.all_reduce(counts, group=group)
        return switch_aux_loss(probs, counts, probs.shape[0] * n, topk, coeff)
    if kind == "seq_aux_loss":
        seq = probs.shape[0] // batch
        p, counts = probs.view(batch, seq, E), routing_map.view(batch, seq, E).sum(1)  # [b, E] per sequence
        if n > 1:
            dist.all_reduce(counts, group=group)
        per_seq = (p.sum(1) * counts.to(p.dtype)).sum(-1) * (E * coeff / (topk * (seq * n) ** 2))
        return per_seq.mean()
    raise ConfigError(f"--moe-router-load-balancing-type {kind!r}: expected one of {', '.join(LOAD_BALANCING_TYPES)}")


def updated_expert_bias(bias: Tensor, tokens_per_expert: Tensor, rate: float) -> Tensor:
    """DeepSeek-V3's aux-loss-free balancing: raise the bias of under-loaded experts, lower it for over-loaded ones."""
    load = tokens_per_expert.to(torch.float64)
    return bias + (torch.sign(load.mean() - load) * rate).to(bias.dtype)


class _AttachLoss(torch.autograd.Function):
    """Forward: x unchanged. Backward: x's gradient passes, and `loss` gets the gradient `scale`."""

    @staticmethod
    def forward(ctx, x: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, g: Tensor):
        (loss,) = ctx.saved_tensors
        return g, torch.full_like(loss, ctx.scale), None


def attach_loss(x: Tensor, loss: Tensor, scale: float) -> Tensor:
    return _AttachLoss.apply(x, loss, scale)


def mtp_depth_losses(logits: list[Tensor], labels: Tensor, cross_entropy=None) -> list[Tensor]:
    """Mean cross-entropy of each MTP depth: depth d (0-based) at position t predicts labels[t + d + 1]; the last
    d + 1 positions have no label (Megatron rolls the labels and the loss mask with zero fill). `cross_entropy`:
    the model's per-token loss (vocab-parallel under tensor parallelism); None: over whole logits."""
    s = labels.shape[1]
    out = []
    for d, lg in enumerate(logits):
        keep = s - d - 1
        if cross_entropy is None:
            out.append(F.cross_entropy(lg[:, :keep].float().reshape(-1, lg.shape[-1]),
                                       labels[:, d + 1:].reshape(-1)))
        else:
            out.append(cross_entropy(lg[:, :keep], labels[:, d + 1:]).mean())
    return out


@dataclass(frozen=True)
class MTPTargets:
    """What each MTP depth reads and predicts on this CP rank: `ids` (the tokens it embeds), `labels`, and `weights`
    (the shifted loss mask / the depth's unmasked token count over the whole micro-batch), each [b, s] per depth."""

    ids: list[Tensor]
    labels: list[Tensor]
    weights: list[Tensor]


def roll_left(x: Tensor, same_doc: Tensor | None = None) -> Tensor:
    """megatron-core's roll_tensor(x, shifts=-1) along the sequence [b, S] of a whole micro-batch: position t takes
    t+1's value, the last position 0; `same_doc` [b, S] (t+1 lies in t's document) zeroes each document's last
    position instead (its packed_seq_params path)."""
    y = F.pad(x[:, 1:], (0, 1))
    return y if same_doc is None else torch.where(same_doc, y, torch.zeros_like(y))


def mtp_targets(tokens: Tensor, labels: Tensor, loss_mask: Tensor, docs: Tensor | None, depths: int, cp: int = 1,
                cp_rank: int = 0) -> MTPTargets:
    """Each depth's shifted ids, labels and loss weights from the whole micro-batch (tokens, labels, loss mask
    [b, S]; docs [b, S] the document of each token when attention is per document, else None), split for CP rank
    `cp_rank` of `cp` as the micro-batch is (zigzag)."""
    from train.parallel.context import zigzag_split

    same_doc = None
    if docs is not None:
        same_doc = torch.zeros_like(docs, dtype=torch.bool)
        same_doc[:, :-1] = docs[:, 1:] == docs[:, :-1]
    out = MTPTargets([], [], [])
    ids, lab, mask = tokens, labels, loss_mask.float()
    for _ in range(depths):
        ids, lab, mask = roll_left(ids, same_doc), roll_left(lab, same_doc), roll_left(mask, same_doc)
        weight = mask / mask.sum().clamp_min(1.0)  # an all-masked depth gives 0, not 0/0
        for store, t in ((out.ids, ids), (out.labels, lab), (out.weights, weight)):
            store.append(zigzag_split(t, cp, cp_rank).contiguous())
    return out


def _recomputing() -> bool:
    """True while autograd runs a backward pass (activation recompute re-runs the forward there): statistics are
    taken once, in the real forward. Megatron guards its counters the same way."""
    return torch._C._current_graph_task_id() != -1


# -- per-stage state -----------------------------------------------------------------------------------------------

_DECODER = re.compile(r"decoder\.layers\.(\d+)\.mlp$")
_MTP = re.compile(r"mtp\.layers\.(\d+)\.transformer_layer\.mlp$")


class MoETraining:
    """Hooks on every router of this stage, and what they accumulate over one step.

    Slots: decoder layer i is slot i, MTP depth j is slot L + j; `counts` [L + D, E] (tokens per expert, actual
    routing), `aux` [L + D] (load-balancing loss / coeff, summed over micro-batches), `mtp` [D] (MTP losses). A
    world all-reduce of the flat statistics serves the bias update and the logs on every rank."""

    def __init__(self, model: nn.Module, cfg: ModelConfig, settings: MoESettings, token_group=None,
                 tp: int = 1, ep: int = 1, cp: int = 1, sequence_parallel: bool = False, etp: int | None = None,
                 dispatcher: str = "alltoall") -> None:
        from train.model import MoELayer

        if settings.load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ConfigError(f"--moe-router-load-balancing-type {settings.load_balancing_type!r}: expected one of "
                              f"{', '.join(LOAD_BALANCING_TYPES)}")
        if settings.router_dtype is not None and settings.router_dtype not in ROUTER_DTYPES:
            raise ConfigError(f"--moe-router-dtype {settings.router_dtype!r}: expected fp32 or fp64")
        self.cfg, self.settings = cfg, settings
        self.token_group = token_group
        self.ep = ep
        self.tp = tp  # TP ranks compute the same (MTP) losses: divided out of the logs
        # without sequence parallelism TP ranks also route the same tokens (their counts are divided out); with it
        # each routes its slice of the sequence, and `token_group` spans TP x CP
        self.token_repeat = 1 if sequence_parallel else tp
        self.etp = tp if etp is None else etp
        self.dispatcher = dispatcher
        self.backward_scale = 1.0  # gradient of an attached loss: the main loss's per-micro-batch scale
        self.cp = cp
        self.aux_scale = 1.0  # the load-balancing loss's: times cp, as the CP ranks' language-model losses are
        self.num_layers, self.depths = cfg.num_layers, cfg.mtp_num_layers
        E = cfg.num_moe_experts or 1
        device = next(model.parameters()).device
        self.counts = torch.zeros(self.num_layers + self.depths, E, dtype=torch.float64, device=device)
        self.aux = torch.zeros(self.num_layers + self.depths, dtype=torch.float64, device=device)
        self.mtp = torch.zeros(self.depths, dtype=torch.float64, device=device)
        self.routers: dict[int, nn.Module] = {}
        self.timers = [m.timer for m in model.modules() if hasattr(m, "timer")]  # expert parallel all-to-alls
        self.host_counts = [m.host_counts for m in model.modules() if hasattr(m, "host_counts")]  # dispatch reads
        # the slots of every MoE layer of the model (all stages): those whose statistics the logs report
        self.moe_slots = torch.tensor([i for i in range(self.num_layers) if cfg.is_moe_layer(i)]
                                      + list(range(self.num_layers, self.num_layers + self.depths)),
                                      dtype=torch.long, device=device)
        self.micro_batches = 0
        for name, m in model.named_modules():
            if not isinstance(m, MoELayer):
                continue
            d, t = _DECODER.match(name), _MTP.match(name)
            if d is None and t is None:
                raise ValueError(f"MoE layer {name!r}: expected decoder.layers.<i>.mlp or "
                                 "mtp.layers.<j>.transformer_layer.mlp")
            slot = int(d.group(1)) if d else self.num_layers + int(t.group(1))
            self._hook(slot, m)

    @property
    def aux_enabled(self) -> bool:
        return self.settings.load_balancing_type != "none" and self.settings.aux_loss_coeff > 0

    def _hook(self, slot: int, layer: nn.Module) -> None:
        router = layer.router
        self.routers[slot] = router
        if self.settings.router_dtype is not None:
            router.logits_dtype = ROUTER_DTYPES[self.settings.router_dtype]
        if router.expert_bias is not None:
            router.expert_bias.data = router.expert_bias.data.float()  # Megatron keeps it in fp32 (updates of 1e-3)
        shape: list = [None]
        layer.register_forward_pre_hook(lambda _m, args: shape.__setitem__(0, args[0].shape[:2]))
        s = self.settings

        def on_route(scores: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
            if not torch.is_grad_enabled():  # evaluation
                return weights
            stats = not _recomputing()
            if stats:  # bincount's numbers, without its CUDA kernel's host read
                self.counts[slot] += expert_counts(indices, self.counts.shape[1]).double()
            if self.aux_enabled:
                probs, rmap = aux_loss_scores(scores, router.score_function, router.topk)
                aux = load_balancing_loss(s.load_balancing_type, probs, rmap, shape[0][0], router.topk,
                                          s.aux_loss_coeff, self.token_group)
                if stats:
                    self.aux[slot] += aux.detach().double() / s.aux_loss_coeff
                weights = attach_loss(weights, aux, self.aux_scale)
            return weights

        router.on_route = on_route

    # -- MTP ----------------------------------------------------------------------------------------------------
    def add_mtp_loss(self, model: nn.Module, loss: Tensor, hidden: Tensor, ids: Tensor, labels: Tensor,
                     extras=None) -> Tensor:
        """The last stage's loss with the MTP loss attached (`hidden`: the decoder output after its final norm, what
        megatron-core's MTP block reads; see GPTModel.mtp_forward). `extras` (context.MicroBatchExtras): this CP
        rank's positions and the whole micro-batch, whose shifted tokens, labels and loss mask the depths read
        (`mtp_targets`); None: one whole sequence per row, positions 0..s-1, every token counted."""
        if not self.depths or self.settings.mtp_loss_scaling_factor == 0:
            return loss
        if not torch.is_grad_enabled():  # evaluation reports the language-model loss only
            return loss
        cp = 1
        if extras is None or extras.whole is None:
            losses = mtp_depth_losses(model.mtp_forward(hidden, ids), labels, model.cross_entropy)
        else:
            lay = extras.layout
            cp = lay.cp
            t = mtp_targets(*extras.whole, lay.docs, self.depths, lay.cp, lay.cp_rank)
            logits = model.mtp_forward(hidden, ids, extras.position_ids, t.ids)
            # this CP rank's share of each depth's mean: the shares sum to the mean over the CP ranks
            losses = [(model.cross_entropy(lg, lb) * w).sum() for lg, lb, w in zip(logits, t.labels, t.weights)]
        if not _recomputing():
            self.mtp += torch.stack([x.detach().double() for x in losses])
        # times cp: the CP ranks' gradients are averaged, as for the language-model loss (its weights carry cp too)
        total = torch.stack(losses).sum() * (self.settings.mtp_loss_scaling_factor * cp / self.depths)
        return attach_loss(loss, total, self.backward_scale)

    # -- per step ---------------------------------------------------------------------------------------------------
    def start_step(self, num_micro: int) -> None:
        self.counts.zero_()
        self.aux.zero_()
        self.mtp.zero_()
        self.micro_batches = num_micro
        self.backward_scale = 1.0 / num_micro
        self.aux_scale = self.cp / num_micro  # Megatron: MoEAuxLossAutoScaler scale cp / num_microbatches
        for t in self.timers:
            t.seconds = 0.0
        for h in self.host_counts:  # counts kept for a recompute that did not come (a step that raised)
            h.clear()

    @torch.no_grad()
    def reduce_stats(self, replicas: int) -> Tensor:
        """Once the step's backward passes have run: sum the statistics over all ranks (one all-reduce) and return,
        on the device, the float64 values the logs need, for the caller to read to the host together with its own
        (the step's one host read; `finish_step` takes them). `replicas`: how many ranks saw each micro-batch's tokens
        of one layer (data-parallel x context-parallel ranks split them; TP ranks repeat them)."""
        comm = torch.full((1,), float(sum(t.seconds for t in self.timers)), dtype=torch.float64,
                          device=self.counts.device)  # a fill, not a host-to-device copy (which waits for the stream)
        flat = torch.cat([self.counts.reshape(-1), self.aux, self.mtp, comm])
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(flat)
        n_counts, n_aux = self.counts.numel(), self.aux.numel()
        counts = flat[:n_counts].view_as(self.counts) / self.token_repeat
        aux = flat[n_counts:n_counts + n_aux] / (self.token_repeat * replicas * self.micro_batches)
        mtp = flat[n_counts + n_aux:-1] / (self.tp * replicas * self.micro_batches)
        self._counts = counts  # for the expert-bias update after the optimizer step
        # per slot: tokens routed (> 0 marks an MoE layer) and max / mean load (integer counts: exact sums, so the
        # same floats per slot as one slot at a time); the balancing loss over the MoE layers; the MTP losses
        return torch.cat([counts.sum(1), counts.amax(1) / counts.mean(1), aux[self.moe_slots].mean().reshape(1),
                          mtp.mean().reshape(1), mtp, flat[-1:] / world])

    @torch.no_grad()
    def finish_step(self, replicas: int, host: list[float] | None = None) -> dict:
        """After the optimizer step: update the expert biases and return the logs. `host`: `reduce_stats`' values
        read to the host (None: reduce and read them here)."""
        if host is None:
            host = self.reduce_stats(replicas).tolist()
        counts = self._counts
        rate = self.settings.bias_update_rate
        for slot, router in self.routers.items():
            if router.expert_bias is not None and rate > 0:
                router.expert_bias.copy_(updated_expert_bias(router.expert_bias, counts[slot], rate))
        S, D = len(counts), self.depths
        sums, ratio = host[:S], host[S:2 * S]
        aux_mean, mtp_mean, mtp, comm = host[2 * S], host[2 * S + 1], host[2 * S + 2:2 * S + 2 + D], host[-1]
        out: dict = {}
        moe = [i for i in range(S) if sums[i] > 0]
        if moe:
            out["moe_load_imbalance"] = {self._slot_name(i): round(ratio[i], 4) for i in moe}
            out["moe_max_load_imbalance"] = max(out["moe_load_imbalance"].values())
        if self.aux_enabled and moe:
            key = "load_balancing_loss" if self.settings.load_balancing_type == "aux_loss" \
                else "seq_load_balancing_loss"
            out[key] = aux_mean
        if self.depths and self.settings.mtp_loss_scaling_factor:
            out["mtp_loss"] = mtp_mean  # what mtp_loss_scaling_factor weighs; per depth below
            out["mtp_depth_losses"] = mtp
        if self.timers:
            out["moe_alltoall_seconds"] = comm  # mean over ranks, forward + backward
        return out

    def _slot_name(self, slot: int) -> str:
        return str(slot) if slot < self.num_layers else f"mtp{slot - self.num_layers}"


def check_mtp_sequence(seq_length: int, cfg: ModelConfig, mtp_loss_scaling_factor: float) -> None:
    """The MTP loss needs a token to predict at its last depth: depth D at position t predicts token t + D + 1, so a
    sequence of D tokens or fewer leaves it nothing (megatron-core would divide by 0)."""
    D = cfg.mtp_num_layers
    if cfg.is_moe and D and mtp_loss_scaling_factor and seq_length <= D:
        raise ConfigError(f"--seq-length {seq_length}: the checkpoint's {D} MTP layer(s) predict up to {D + 1} tokens "
                          f"ahead, which needs --seq-length > {D}; use a longer sequence or "
                          "--mtp-loss-scaling-factor 0")


def settings_of(args, cfg: ModelConfig) -> MoESettings:
    """The run's MoEArgs resolved against the checkpoint (either engine's)."""
    coeff = args.moe_aux_loss_coeff if args.moe_aux_loss_coeff is not None else cfg.moe_aux_loss_coeff
    return MoESettings(args.moe_router_load_balancing_type, float(coeff), args.moe_router_bias_update_rate,
                       args.mtp_loss_scaling_factor, args.moe_router_dtype)


def setup(args, cfg: ModelConfig, model: nn.Module, groups, sequence_parallel: bool = False) -> MoETraining | None:
    """The MoE training state of this stage (None for a dense model). `args`: the run's MoEArgs; the aux-loss
    coefficient defaults to the checkpoint's (HF router_aux_loss_coef / aux_loss_alpha)."""
    if not cfg.is_moe:
        return None
    settings = settings_of(args, cfg)
    # the ranks splitting one sequence (context parallel, and TP under sequence parallelism) share its token counts
    sp = sequence_parallel and groups.dims.tp > 1
    return MoETraining(model, cfg, settings, token_group=groups.tp_cp if sp else groups.cp, tp=groups.dims.tp,
                       ep=groups.dims.ep, cp=groups.dims.cp, sequence_parallel=sp,
                       etp=getattr(groups.dims, "expert_tp", groups.dims.tp),
                       dispatcher=args.moe_token_dispatcher_type)


def describe(m: MoETraining) -> str:
    s, c = m.settings, m.cfg
    parts = [f"MoE: {c.num_moe_experts} experts, top-{c.moe_router_topk}, ep {m.ep}"
             + (f", expert tp {m.etp}" if m.etp > 1 or m.tp > 1 else "") + f", dispatch {m.dispatcher} (dropless)",
             f"load balancing {s.load_balancing_type} coeff {s.aux_loss_coeff:g}" if m.aux_enabled
             else "no load-balancing loss"]
    if c.moe_router_enable_expert_bias:
        parts.append(f"expert bias update rate {s.bias_update_rate:g}")
    if c.mtp_num_layers:
        parts.append(f"MTP {c.mtp_num_layers} depth(s), loss x {s.mtp_loss_scaling_factor:g}")
    if s.router_dtype:
        parts.append(f"router {s.router_dtype}")
    return "; ".join(parts)
