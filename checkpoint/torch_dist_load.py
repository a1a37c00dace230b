"""A torch_dist checkpoint as the trainer's `--load` reads it (Megatron-LM's own or a shardkit save), opened through
checkpoint.opened (open_for_training): in place, by region, straight from its DCP items (no staging copy: a staging
import would cost the model's size in disk and a full pass before step 1, and every rank would wait for one rank to
write it). Each rank reads only its own regions of the weights, and of the optimizer state of the parameters it owns,
through the sharding table at any layout (TorchDistSource: key matching, vocab padding; Checkpoint.read_local: the
regions). Megatron's distributed-optimizer state (`optimizer.state.{param|fp32_param,exp_avg,exp_avg_sq}.<key>`,
fully_reshardable, or 0.19's dp_reshardable flat buffers where their layout is proved) becomes the main parameters and
Adam moments, its param groups' `step` the Adam step count, and common.pt's `opt_param_scheduler`, `iteration` and
`args.consumed_train_samples` the schedule and the position in the data. A shardkit save carries its whole
train_state.json in common.pt (`shardkit_train_state`): that one is taken verbatim (RNG, data identity, FP8 state
included), so a torch_dist save resumes exactly as a native one. The save is train/torch_dist_ckpt.py's."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .config import ModelConfig
from .errors import FormatError
from .layout import Layout
from .manifest import Manifest
from .megatron import TRAIN_STATE_KEY, arg, is_scheduler_state, megatron_optimizer_groups, source_keys
from .megatron_bridge import FLAT_PREFIX, flat_buffers
from .reader import Checkpoint, vocab_padding
from .sharding import OPTIMIZER_STATES, split_optimizer_key
from .torch_dist import read_torch_dist
from .torch_dist_view import TorchDistSource, import_optimizer_states, match_keys, plan_import, read_layout


class TorchDistLoad(TorchDistSource):
    """A torch_dist checkpoint as the trainer reads it (what it reads of a native Checkpoint: config, path, layout,
    optimizer_states, hf_dir(), read_local for any layout), the model config as for reshard: `hf_config`, else the
    checkpoint's shardkit.json, else its Megatron-LM args with `vocab_size`. `load_optim`: the optimizer state is
    matched (all three states for every tensor, or none at all: partial state is one line naming what is missing)."""

    read_local = Checkpoint.read_local  # region reads through the sharding table, vocab padding of the target

    def __init__(self, path: str | Path, hf_config: str | None = None, vocab_size: int | None = None,
                 load_optim: bool = True):
        td = read_torch_dist(path)
        cfg, origin = td.model_config(hf_config or None, vocab_size)
        layout = read_layout(td, cfg)
        if load_optim and flat_buffers(td) and not _attach_flat_optimizer(td, cfg):
            raise FormatError(f"{td.path}: its optimizer state is Megatron-LM's dp_reshardable flat buffers "
                              f"({FLAT_PREFIX}*) in a form whose bucket layout shardkit cannot rebuild and prove (it "
                              "resumes TP 1 / PP 1, one bucket, a dense local-spec model in fp32); pass "
                              "--no-load-optim to start the optimizer fresh from its weights")
        states = import_optimizer_states(td) if load_optim else []
        if states:
            self._check_optimizer(td, cfg, layout, states)
        optimizer = states or None
        self.td, self.path, self.origin = td, td.path, origin
        entries, self.keys = plan_import(td, cfg, layout, None, optimizer, origin)
        self.manifest = Manifest(td.iteration, cfg, layout, entries, optimizer=optimizer)
        # vocab tensors: the stored rows as stored (Megatron's padding rows as it trained them, so that a resume at
        # the saving layout is exact), rows past them vocab_fill's
        self.vocab = {n: td.tensors[self.keys[n]].shape[0] for n in vocab_padding(cfg, layout, optimizer)}
        self.hf_config = hf_config
        self.hf_dir()  # a shardkit save's hf/ linked out of the iteration: refused before training

    def _stored(self, key: str, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """torch.load of the items (_attach_flat_optimizer puts views over Megatron-LM 0.19's flat optimizer buffers
        behind td.read)."""
        return self.td.read(key, box)

    @staticmethod
    def _check_optimizer(td, cfg: ModelConfig, layout: Layout, states: list[str]) -> None:
        hint = "cannot resume the optimizer (pass --no-load-optim to start it fresh)"
        absent = [s for s in OPTIMIZER_STATES if s not in states]
        if absent:
            names = {"fp32_param": "param (fp32 main parameters)"}
            raise FormatError(f"{td.path}: partial optimizer state: no optimizer.state."
                              f"{', no optimizer.state.'.join(names.get(s, s) for s in absent)} tensors beside "
                              f"{', '.join(names.get(s, s) for s in states)}; {hint}")
        every = Manifest(0, cfg, layout, {}, optimizer=states).specs()
        if match_keys(td, [s for s in every if split_optimizer_key(s.name) is None])[1]:
            return  # the weights do not match the model config: plan_import says so (not "partial optimizer state")
        specs = [s for s in every if split_optimizer_key(s.name)]
        _, missing, _ = match_keys(td, specs)
        if missing:
            raise FormatError(f"{td.path}: partial optimizer state: {len(missing)} of {len(specs)} optimizer tensors "
                              f"are missing, e.g. {source_keys(missing[0])[0]}; {hint}")

    @property
    def optimizer_states(self) -> list[str]:
        return list(self.manifest.optimizer or [])

    @property
    def train_state_source(self) -> str:
        """Where train_state() reads: common.pt (a shardkit save's train_state.json rides in it)."""
        return str(self.td.common_source)

    def train_state(self, global_batch_size: int) -> tuple[dict | None, list[str]]:
        """The trainer's state at this checkpoint and notes to log. A shardkit save: its train_state.json, carried
        verbatim in common.pt. Megatron-LM's own: iteration, consumed samples (args.consumed_train_samples), the
        optimizer step (its param groups' `step`), the scheduler state; None for iteration 0 (a converted model)."""
        common = self.td.common or {}
        where = self.td.common_source
        carried = common.get(TRAIN_STATE_KEY)
        if isinstance(carried, str):
            try:
                state = json.loads(carried)
            except (ValueError, RecursionError):
                raise FormatError(f"{where}: {TRAIN_STATE_KEY} is not valid JSON; the checkpoint is damaged") from None
            if not isinstance(state, dict) or not isinstance(state.get("iteration"), int):
                raise FormatError(f"{where}: {TRAIN_STATE_KEY} holds no iteration; the checkpoint is damaged")
            return state, []
        it = self.td.iteration
        if it <= 0:
            return None, []
        notes = []
        consumed = arg(self.td.args, "consumed_train_samples")
        if not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0:
            consumed = it * global_batch_size
            notes.append(f"note: {where} args hold no consumed_train_samples: taking iteration {it} x "
                         f"--global-batch-size {global_batch_size} = {consumed} samples")
        state: dict[str, Any] = {"iteration": it, "consumed_samples": consumed}
        groups = megatron_optimizer_groups(common.get("optimizer"))
        steps = {g.get("step") for g in groups or [] if isinstance(g, dict) and g.get("step") is not None}
        if len(steps) > 1:
            raise FormatError(f"{where}: the optimizer's param groups hold different steps {sorted(steps)}")
        if steps:
            step = steps.pop()
            if isinstance(step, torch.Tensor):
                step = step.item()
            state["optimizer_steps"] = int(step)
        sched = common.get("opt_param_scheduler")
        if is_scheduler_state(sched):
            state["scheduler"] = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in sched.items()}
        notes.append(f"note: {self.path} is Megatron-LM's own checkpoint: its RNG state is not read (shardkit's "
                     "generators start from --seed)")
        return state, notes


def _attach_flat_optimizer(td, cfg: ModelConfig) -> bool:
    """Megatron-LM 0.19's dp_reshardable distributed-optimizer state as the model-space tensors the load reads
    (`optimizer.state.{param,exp_avg,exp_avg_sq}.<key>`, views of the flat buffers at the bucket layout rebuilt from
    the model and proved against the stored fp32 `param` buffer: checkpoint.megatron_bridge.flat_layout_proved), and
    its param groups (the Adam step) where train_state looks for them. False (nothing attached) where the layout
    cannot be rebuilt and proved: the caller refuses the optimizer in one line."""
    from .megatron_bridge import flat_layout_proved
    from .torch_dist import TDTensor
    from .torch_dist_pickle import load_common

    bufs = flat_buffers(td)
    if (set(bufs) != {"param", "exp_avg", "exp_avg_sq"} or arg(td.args, "transformer_impl") != "local"
            or (td.layout or Layout()).tp != 1 or (td.layout or Layout()).pp != 1):
        return False
    spans = flat_layout_proved(td, cfg.num_layers)
    groups_key = next((k for k in td.objects if k.startswith(FLAT_PREFIX) and ".optimizer/" in k), None)
    if spans is None or groups_key is None:
        return False
    info = td._storage[(groups_key, None)]
    td.check_item(groups_key, None)
    with open(td.path / info.relative_path, "rb") as f:
        f.seek(int(info.offset))
        data = f.read(int(info.length))
    entry, _ = load_common(td.path / f"{info.relative_path} item {groups_key}", data)
    if not isinstance(entry, dict) or not isinstance(entry.get("param_groups"), list):
        return False
    views: dict[str, tuple[str, list[tuple[int | None, int, int]]]] = {}
    for state, (bkey,) in bufs.items():
        for key, layer, start, n in spans:
            vkey = f"optimizer.state.{state}.{key}"
            views.setdefault(vkey, (bkey, []))[1].append((layer, start, n))
            shape = td.tensors[key].shape
            td.tensors[vkey] = TDTensor(vkey, shape, td.tensors[bkey].dtype, [((0,) * len(shape), shape)])
    base_read, cache = td.read, {}

    def read(name: str, box=None):
        if name not in views:
            return base_read(name, box)
        bkey, parts = views[name]
        if bkey not in cache:
            cache.clear()
            cache[bkey] = base_read(bkey)
        buf, shape = cache[bkey], td.tensors[name].shape
        whole = torch.empty(shape, dtype=buf.dtype)
        for layer, start, n in parts:
            (whole if layer is None else whole[layer]).copy_(buf[start:start + n].view(
                shape if layer is None else shape[1:]))
        box = tuple((0, s) for s in shape) if box is None else tuple(box)
        return whole[tuple(slice(a, b) for a, b in box)].clone()

    td.read = read
    common = dict(td.common or {})
    common["optimizer"] = {**(common.get("optimizer") or {}), "optimizer": {"param_groups": entry["param_groups"]}}
    td.common = common
    return True
