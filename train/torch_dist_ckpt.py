"""continue-pretrain's save in Megatron-LM's `--ckpt-format torch_dist` (issue 17, "Train from it and back"); the load
(`--load` of a torch_dist checkpoint, read in place by region) is checkpoint/torch_dist_load.py's, reached through
checkpoint.opened.open_for_training as a native one is.

Save (save): Megatron-LM's torch_dist with every rank writing its own items (`__<rank>_0.distcp`: the same owners and
regions as the native save, one DCP item per native chunk), the `_extra_state` objects megatron-core's GPTModel asks
for (rank 0), then rank 0 writes DCP's `.metadata` from every rank's storage entries, common.pt (Megatron-LM's whole
args namespace with the run's training flags, iteration, the optimizer's param groups and step, the scheduler, the
consumed samples, train_state.json verbatim), shardkit.json + hf/, and commits through checkpoint.commit (the
iteration under a `.partial` name, renamed when durable, `latest_checkpointed_iteration.txt` last). Megatron's RNG
state is not written (args.no_save_rng; shardkit's own RNG state rides in train_state.json).

Key naming and rank ownership come from checkpoint.megatron, the format from checkpoint.torch_dist: the same code the
converters use, no second copy.
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
from checkpoint.errors import WriteError
from checkpoint.faults import fault_point
from checkpoint.layout import Layout
from checkpoint.manifest import Manifest, iter_dirname
from checkpoint.megatron import TRACKER, extra_state_objects, megatron_common, stored_key
from checkpoint.reader import entry_nbytes
from checkpoint.sharding import OPTIMIZER_STATES, split_optimizer_key
from checkpoint.megatron_bridge import write_run_config
from checkpoint.torch_dist import HF_SUBDIR
from checkpoint.torch_dist_sidecar import write_sidecar
from checkpoint.torch_dist_write import DCPWriter, none_object_bytes, write_common, write_integrity
from train import checkpointing as ckpt_io
from train.optim import DistributedOptimizer
from train.parallel.groups import Groups


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
