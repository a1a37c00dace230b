"""continue-pretrain from and to Megatron-LM's `--ckpt-format torch_dist` (issue 17, "Train from it and back").

Load (TorchDistLoad): the checkpoint is read in place, by region, straight from its DCP items (no staging copy: a
staging import would cost the model's size in disk and a full pass before step 1, and every rank would wait for one
rank to write it). Each rank reads only its own regions of the weights, and of the optimizer state of the parameters
it owns, through the sharding table at any layout (TorchDistSource: key matching, vocab padding; Checkpoint.read_local:
the regions). Megatron's distributed-optimizer state (`optimizer.state.{param|fp32_param,exp_avg,exp_avg_sq}.<key>`,
fully_reshardable) becomes the main parameters and Adam moments, its param groups' `step` the Adam step count, and
common.pt's `opt_param_scheduler`, `iteration` and `args.consumed_train_samples` the schedule and the position in the
data. A shardkit save carries its whole train_state.json in common.pt (`shardkit_train_state`): that one is taken
verbatim (RNG, data identity, FP8 state included), so a torch_dist save resumes exactly as a native one.

Save (save): Megatron-LM's torch_dist with every rank writing its own items (`__<rank>_0.distcp`: the same owners and
regions as the native save, one DCP item per native chunk), the `_extra_state` objects megatron-core's GPTModel asks
for (rank 0), then rank 0 writes DCP's `.metadata` from every rank's storage entries, common.pt (Megatron-LM's whole
args namespace with the run's training flags, iteration, the optimizer's param groups and step, the scheduler, the
consumed samples, train_state.json verbatim), shardkit.json + hf/, and commits through checkpoint.commit (the
iteration under a `.partial` name, renamed when durable, `latest_checkpointed_iteration.txt` last). Megatron's RNG
state is not written (args.no_save_rng; shardkit's own RNG state rides in train_state.json).

Key naming and rank ownership come from checkpoint.megatron, key matching and in-place reading from
checkpoint.torch_dist_view, the format from checkpoint.torch_dist: the same code the converters use, no second copy.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import torch

from checkpoint import store
from checkpoint.commit import PARTIAL_SUFFIX
from checkpoint.config import ModelConfig
from checkpoint.errors import FormatError, ShardkitError, WriteError
from checkpoint.faults import fault_point
from checkpoint.layout import Layout
from checkpoint.manifest import Manifest, iter_dirname
from checkpoint.megatron import (TRACKER, TRAIN_STATE_KEY, arg, extra_state_objects, megatron_common,
                                 megatron_optimizer_groups, source_keys, stored_key)
from checkpoint.reader import Checkpoint, entry_nbytes, vocab_padding
from checkpoint.sharding import OPTIMIZER_STATES, split_optimizer_key
from checkpoint.megatron_bridge import FLAT_PREFIX, flat_buffers, write_run_config
from checkpoint.torch_dist import HF_SUBDIR, read_torch_dist
from checkpoint.torch_dist_sidecar import write_sidecar
from checkpoint.torch_dist_write import DCPWriter, none_object_bytes, write_common, write_integrity
from checkpoint.torch_dist_view import TorchDistSource, import_optimizer_states, match_keys, plan_import
from train import checkpointing as ckpt_io
from train.optim import DistributedOptimizer, is_scheduler_state
from train.parallel.groups import Groups


# -- load -------------------------------------------------------------------------------------------------------------

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
        layout = td.layout or Layout()
        try:
            layout.check(cfg)
        except ShardkitError:  # args whose layout does not fit the model (e.g. --hf-config's): read at tp=pp=1
            layout = Layout()
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
        self._hf = Path(hf_config) if hf_config else td.hf_dir()

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

    def hf_dir(self) -> Path | None:
        """Tokenizer / config files: --hf-config, else the hf/ of a shardkit save (None for Megatron-LM's own)."""
        return self._hf

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
    from checkpoint.megatron_bridge import flat_layout_proved
    from checkpoint.torch_dist import TDTensor
    from checkpoint.torch_dist_pickle import load_common

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


# -- save -------------------------------------------------------------------------------------------------------------

def megatron_param_groups(opt: DistributedOptimizer, lr: float, wd: float, max_lr: float, min_lr: float,
                          experts: bool) -> list[dict]:
    """megatron-core's distributed-optimizer param groups as its state_dict() saves them (torch Adam's fields, the
    `step`, Megatron's identifier keys wd_mult / lr_mult / is_expert_parallel / is_decoupled_lr): decayed weights,
    then biases and 1-D parameters (wd_mult 0), then the same for expert parameters in a MoE model; only the groups
    that hold parameters (of this rank's model, as megatron-core builds them), so that its load_state_dict finds
    each group it builds (`_common` puts the expert groups in the expert optimizer of its ChainedOptimizer)."""
    c = opt.cfg
    base = {"lr": lr, "betas": [c.adam_beta1, c.adam_beta2], "eps": c.adam_eps, "amsgrad": False,
            "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
            "decoupled_weight_decay": True, "lr_mult": 1.0, "is_decoupled_lr": False, "default_config": True,
            "max_lr": max_lr, "min_lr": min_lr, "step": opt.steps}
    kinds = {(bool(e), p.ndim == 1 or n.endswith(".bias")) for n, p, e in zip(opt.names, opt.params, opt.expert)}
    out = []
    for expert in ((False, True) if experts else (False,)):
        for mult in (1.0, 0.0):
            if (expert, mult == 0.0) in kinds:
                out.append(dict(base, weight_decay=wd * mult, wd_mult=mult, is_expert_parallel=expert))
    return out


def _common(cfg: ModelConfig, layout: Layout, key_naming: str, dtype: str, iteration: int, state: dict,
            param_groups: list[dict], training_args: dict) -> dict:
    """The common state of a training save: Megatron-LM's entries, plus train_state.json verbatim."""
    return megatron_common(cfg, layout, key_naming, dtype, iteration, optimizer=True, param_groups=param_groups,
                           scheduler=state.get("scheduler"), consumed_samples=int(state["consumed_samples"]),
                           train_state=json.dumps(state, indent=1) + "\n", training_args=training_args)


def save(root: Path, iteration: int, cfg: ModelConfig, layout: Layout, table: list[ckpt_io.LocalParam],
         opt: DistributedOptimizer, groups: Groups, train_state: dict, assets_from: Path | None, provenance: dict,
         key_naming: str, param_groups: list[dict], training_args: dict,
         async_group: Any = None, integrity: bool = False) -> Path | ckpt_io.AsyncSave | None:
    """One training checkpoint in torch_dist, written by every rank (see the module's doc); returns the committed
    iteration directory on rank 0 (an AsyncSave with `async_group`, as checkpointing.save); with `integrity`
    (--verify-integrity) integrity.json last."""
    root = Path(root)
    dtypes = ckpt_io.gather_dtypes(table)
    entries = ckpt_io._entries(cfg, layout, dtypes)
    writer = ckpt_io.open_on_rank0(root, iteration, "train-save-torch_dist", entries, groups,
                                   pointer=(TRACKER, f"{iteration}\n"))
    err: list = [None]
    partial = root / f"{iter_dirname(iteration)}{PARTIAL_SUFFIX}"
    items: list[tuple[str, tuple[int, ...], torch.Tensor]] = []  # (DCP key, global offsets, value) this rank writes
    try:
        for lp, values in ckpt_io.saved_values(table, opt, groups):
            for key, value in values.items():
                items += [(stored_key(key, key_naming), offs, v)
                          for _, offs, v in ckpt_io._boxes(entries[key], lp, value, layout, groups, cfg.num_layers)]
        if async_group is not None:  # training goes on at once and changes the parameters: write copies
            items = [(k, offs, v.to("cpu", copy=True)) for k, offs, v in items]
    except Exception as e:
        err = [f"rank {groups.rank}: {type(e).__name__}: {e}"]
    specs = {s.name: s for s in Manifest(0, cfg, layout, {}, optimizer=list(OPTIMIZER_STATES)).specs()}
    objects = ([key for name, s in specs.items() if split_optimizer_key(name) is None
                for key, _ in extra_state_objects(s, layout, cfg.num_layers)] if groups.rank == 0 else [])
    store_state = dict(train_state, optimizer_steps=opt.steps)

    def finish() -> Path | None:
        storage: dict = {}
        if not err[0]:
            try:
                w = DCPWriter(partial)
                with w.rank_file(groups.rank) as f:
                    for key, offs, value in items:
                        fault_point("store.write")
                        f.add_tensor(key, offs, value)
                    blob = none_object_bytes()
                    for key in objects:
                        f.add_bytes(key, blob)
                storage = w.storage_data
            except Exception as e:
                err[0] = f"rank {groups.rank}: {type(e).__name__}: {e}"
        items.clear()  # the copies of an async save
        gathered = ckpt_io.from_every_rank((err[0], storage), async_group)
        bad = [e for e, _ in gathered if e]
        if bad:
            failure = WriteError(f"checkpoint save failed: {bad[0]}")
            if writer is not None:  # removes the partial iteration (its own error adds the free space)
                writer.__exit__(WriteError, failure, None)
            raise failure

        def commit() -> Path:
            meta = DCPWriter(writer.partial)
            for name, e in entries.items():
                chunks = [(offs, tuple(min(c, n - o) for o, c, n in zip(offs, e.chunk, e.shape)))
                          for offs in itertools.product(*[range(0, n, c) for n, c in zip(e.shape, e.chunk)])]
                meta.declare_tensor(stored_key(name, key_naming), e.shape, store.torch_dtype(e.dtype), chunks)
            for key in objects:
                meta.declare_object(key)
            for _, st in gathered:
                meta.storage_data.update(st)
            weights: dict[str, int] = {}
            for name, e in entries.items():
                if split_optimizer_key(name) is None:
                    weights[e.dtype] = weights.get(e.dtype, 0) + entry_nbytes(e)
            dtype = max(weights, key=weights.get)
            write_common(writer.partial, _common(cfg, layout, key_naming, dtype, iteration, store_state,
                                                 param_groups, training_args), meta)
            meta.write_metadata(str(writer.final))
            write_sidecar(writer.partial, iteration=iteration, model=cfg, layout=layout, dtype=dtype,
                          key_naming=key_naming, optimizer=list(OPTIMIZER_STATES), provenance=provenance)
            write_run_config(writer.partial, cfg, layout, dtype)  # for Megatron-Bridge
            hf = writer.partial / HF_SUBDIR
            hf.mkdir()
            if assets_from is not None and Path(assets_from).is_dir():  # known side-file names only, never links
                from checkpoint.safety import copy_side_files

                copy_side_files(assets_from, hf, exclude=("config.json",))
            (hf / "config.json").write_text(json.dumps(cfg.to_hf(dtype=dtype), indent=2) + "\n")
            if integrity:  # --verify-integrity (Megatron-LM's): one more read of the save's files
                write_integrity(writer.partial)
            return writer.commit(None)

        return ckpt_io.commit_on_rank0(writer, groups, async_group, commit)

    return finish() if async_group is None else ckpt_io.AsyncSave(finish)
