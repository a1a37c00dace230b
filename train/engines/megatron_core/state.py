"""The engine's optimizer and FP8 state as shardkit's save path reads them: SavedState (the distributed optimizer's
fp32 params and moments gathered back into shardkit's canonical tensors per region, per-expert weights stacked by
layer), FP8State (Transformer Engine's delayed-scaling state in the native engine's JSON form and names)."""
from __future__ import annotations

import re

import torch
import torch.distributed as dist

from checkpoint.errors import ConfigError, FormatError
from checkpoint.sharding import OPTIMIZER_STATES


def expert_biases(model) -> list:
    """The routers' expert_bias buffers (DeepSeek-V3's aux-loss-free balancing: megatron-core updates them in
    finalize_model_grads from the tokens each expert received, outside the optimizer), loaded and saved with the
    weights; kept in fp32 as megatron-core's router keeps them (Float16Module would have cast them to bf16)."""
    out = []
    for name, buf in model.named_buffers():
        if name.endswith(".router.expert_bias"):
            buf.data = buf.data.float()
            out.append((name, buf))
    return out


def distributed_parts(mopt) -> list:
    """The DistributedOptimizers of get_megatron_optimizer's result (a ChainedOptimizer of one, for a dense model)."""
    return list(getattr(mopt, "chained_optimizers", [mopt]))


class SavedState:
    """What shardkit's save path (ckpt_io.saved_values, the finiteness check, the param groups) asks of an optimizer:
    names, params, expert flags, the flags' config, the step count, which parameters this rank writes (round-robin
    over DP ranks, whole tensors; under CP the DP rank's CP rank 0, as ckpt_io.saved_values writes) and their fp32
    params and moments. `refresh()` collects them from megatron-core's distributed optimizer (each rank's flat ranges:
    its shards are over DP x CP, every CP rank holding the same weights) into shardkit's tensors, every rank taking
    part.
    megatron-core's per-expert weights are saved stacked by layer (a chunk of an expert tensor holds a layer's local
    experts together): `table` is the table a save writes, its stacks taken afresh by `refresh()`."""

    def __init__(self, table, mopt, cfg, groups, dp: int, expert: frozenset = frozenset()) -> None:
        self.entries = stacked_entries(table)  # (saved LocalParam, its megatron-core parameters' LocalParams)
        self.table = [lp for lp, _ in self.entries]
        trained = [k for k, (lp, _) in enumerate(self.entries) if not lp.tied_copy and lp.param.requires_grad]
        self._trained = trained
        self.names = [self.table[k].name for k in trained]
        self.params = [self.table[k].param for k in trained]
        self.expert = [self.table[k].spec.name in expert for k in trained]
        self.cfg, self.mopt, self.groups, self.dp = cfg, mopt, groups, dp
        # expert weights' optimizer state is sharded over their expert-data-parallel group (as native's)
        self.owner = [i % (groups.dims.edp if e else dp) for i, e in enumerate(self.expert)]
        self.steps = 0
        self._state: dict[int, dict[str, torch.Tensor]] = {}

    def is_mine(self, i: int | None) -> bool:
        g = self.groups
        if i is None:
            return False
        return self.owner[i] == g.edp_rank if self.expert[i] else (self.owner[i] == g.dp_rank and g.cp_rank == 0)

    def owned(self) -> list[int]:
        return [i for i in range(len(self.names)) if self.is_mine(i)]

    def state_of(self, i: int) -> dict[str, torch.Tensor]:
        return self._state[i]

    @torch.no_grad()
    def refresh(self) -> None:
        """Each parameter's fp32 param and moments, whole, on the DP rank that writes it (and only there): every DP
        rank puts its range of the distributed optimizer's shard into a zero buffer, one reduce per parameter to the
        owner (x + 0 = x: exact). What a rank keeps is 1/DP of its model-parallel shard's optimizer state, on the
        host; the transient buffer is one parameter's. Stacked entries take their members' weights afresh."""
        import dataclasses

        from megatron.core import parallel_state as ps

        g = self.groups
        dense = ps.get_data_parallel_group(with_context_parallel=True)  # the optimizer's shards: over DP x CP
        expert = ps.get_expert_data_parallel_group() if any(self.expert) else None
        ranks = {pg: dist.get_process_group_ranks(pg) for pg in (dense, expert) if pg is not None}
        parts = distributed_parts(self.mopt)
        self._state = {}
        for k, (lp, members) in enumerate(self.entries):
            if len(members) > 1 or members[0] is not lp:
                self.entries[k] = (dataclasses.replace(lp, param=torch.stack([m.param.detach() for m in members])),
                                   members)
        self.table = [lp for lp, _ in self.entries]
        self.params = [self.table[k].param for k in self._trained]
        for i, k in enumerate(self._trained):
            group = expert if self.expert[i] else dense
            # the owner's global rank: of the expert-data-parallel group (spanning DP x CP), or DP rank `owner` at
            # CP rank 0 beside this rank
            dst = (ranks[group][self.owner[i]] if self.expert[i]
                   else g.dims.rank(tp=g.tp_rank, cp=0, dp=self.owner[i], pp=g.pp_rank))
            mine, states = self.is_mine(i), []
            for m in self.entries[k][1]:
                p = m.param
                buf = torch.zeros(3, p.numel(), dtype=torch.float32, device=p.device)
                for part in parts:
                    if p in part.model_param_gbuf_map:  # this DP rank holds a range of it
                        r = part._get_model_param_range_map(p)["param"]
                        t = part._get_main_param_and_optimizer_states(p)
                        for j, key in enumerate(("param", "exp_avg", "exp_avg_sq")):
                            buf[j, r.start:r.end] = t[key].detach().reshape(-1)
                if len(ranks[group]) > 1:
                    dist.reduce(buf, dst=dst, group=group)
                if mine:  # (the other ranks' buffers are partial sums: never copied to the host)
                    states.append(buf.cpu().view(3, *p.shape))
            if mine:
                both = states[0] if len(states) == 1 else torch.stack(states, dim=1)
                self._state[i] = {s: both[j] for j, s in enumerate(OPTIMIZER_STATES)}


def stacked_entries(table) -> list:
    """The saved table of megatron-core's parameters: each its own entry, except one layer's local experts of one
    expert tensor, stacked in expert order into one entry (named as megatron-core's GroupedMLP would name it)."""
    import dataclasses

    out, stacks = [], {}
    for lp in table:
        if lp.expert is None:
            out.append((lp, [lp]))
            continue
        key = (lp.spec.name, lp.vstage, lp.index)
        if key not in stacks:
            stacks[key] = []
            name = re.sub(r"\.local_experts\.\d+\.", ".", lp.name)
            out.append((dataclasses.replace(lp, name=name, expert=None), stacks[key]))
        stacks[key].append(lp)
    for members in stacks.values():
        members.sort(key=lambda m: m.expert)
        if [m.expert for m in members] != list(range(len(members))):
            raise FormatError(f"{members[0].name}: local experts {[m.expert for m in members]} are not 0..n-1")
    return out


class Backend:
    """What the native loop asks of its backend: a description and the FP8 delayed-scaling state (FP8State; None
    without delayed scaling), saved into and resumed from train_state.json's "fp8" as the native engine's."""

    def __init__(self, line: str, fp8: FP8State | None = None) -> None:
        self.line, self.fp8 = line, fp8

    def describe(self) -> str:
        return self.line

    def state_dict(self, groups):
        return self.fp8.gather_state(groups) if self.fp8 is not None else None

    def load_state_dict(self, state, src) -> None:
        if self.fp8 is not None and state is not None:  # none saved: TE's initial state (scale 1), as native
            self.fp8.load_state_dict(state, str(src))


class FP8State:
    """megatron-core's TE linears' delayed-scaling state (each one-GEMM TE module's fp8_meta: amax histories and
    scales) in the native engine's JSON form and names (train/te.py modules_state / load_modules_state; train/fp8.py
    gather_state), so an FP8 run resumes on either engine: each module by its global canonical name
    (`fp8_module_name`). Loading sets a module up first under megatron-core's own FP8 context
    (fp8_utils.get_fp8_context: the recipe its forward uses)."""

    def __init__(self, fp8, modules: list, context, every_rank: bool) -> None:
        self.cfg, self.modules, self.context, self.every_rank = fp8, modules, context, every_rank

    @classmethod
    def of(cls, fp8, chunks, starts: list[int], expert_offset: int, config, every_rank: bool) -> FP8State | None:
        """The state of the model chunks' TE linears (None unless --fp8-recipe delayed), `starts` each chunk's first
        global layer, `expert_offset` this rank's first global expert."""
        if fp8 is None or not fp8.enabled or fp8.fp8_recipe != "delayed":
            return None
        modules = [(fp8_module_name(name, starts[v], expert_offset), mod)
                   for v, chunk in enumerate(chunks) for name, mod in chunk.named_modules() if is_te_linear(mod)]

        def context():
            from megatron.core.fp8_utils import get_fp8_context

            return get_fp8_context(config)

        return cls(fp8, modules, context, every_rank)

    def state_dict(self) -> dict | None:
        from train.te import modules_state

        return modules_state(self.cfg, self.modules)

    def gather_state(self, groups) -> dict | None:
        from train.fp8 import gather_state

        return gather_state(self, groups, self.every_rank)

    def load_state_dict(self, sd: dict, where: str) -> None:
        from train.te import load_modules_state

        saved = {k.rsplit(".", 1)[0] for k in sd.get("tensors", {})}
        missing = [name for name, _ in self.modules if name not in saved]
        if saved and missing:  # e.g. a native save: its FP8 leaves routed experts and MTP layers in high precision
            raise ConfigError(f"{where}: no FP8 delayed-scaling state for {len(missing)} of this run's "
                              f"{len(self.modules)} TE linears ({missing[0]}, ...): the checkpoint's FP8 run kept "
                              "them in high precision (the native engine does so for routed experts and MTP layers); "
                              "resume with --engine native, or with --fp8-recipe tensorwise (no state to resume)")
        load_modules_state(self.cfg, self.modules, sd, where, self.context)


def is_te_linear(module) -> bool:
    """A Transformer Engine one-GEMM module (te.Linear, te.LayerNormLinear: megatron-core's TELinear,
    TEColumnParallelLinear, TERowParallelLinear, TELayerNormColumnParallelLinear), which keeps delayed-scaling state
    in fp8_meta; TE's attention (no weight) and megatron-core's own modules are not."""
    return (hasattr(module, "fp8_meta") and callable(getattr(module, "init_fp8_metadata", None))
            and isinstance(getattr(module, "weight", None), torch.Tensor))


def fp8_module_name(name: str, start: int, expert_offset: int) -> str:
    """A module's global canonical name from its name in a model chunk: the decoder layer's global number (the
    chunk's first layer `start` plus the local one) and an expert's global index (SequentialMLP's local expert plus
    this rank's first, `expert_offset`); MTP's layers keep megatron-core's depth numbers."""
    hit = re.fullmatch(r"decoder\.layers\.(\d+)\.(.*)", name)
    if hit is None:
        return name
    rest = re.sub(r"(\.experts\.local_experts\.)(\d+)\.", lambda e: f"{e[1]}{int(e[2]) + expert_offset}.", hit[2])
    return f"decoder.layers.{start + int(hit[1])}.{rest}"
