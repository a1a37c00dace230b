"""The trainer's numeric backend in one place: which implementation builds the layers (`--transformer-impl`) and
whether their GEMMs run in FP8 (`--fp8-format`), applied to a stage by train/parallel/parallelize.py before its
parameters are registered in the sharding table, plus the FP8 scaling state that a checkpoint carries.

    local              the plain-PyTorch model; with --fp8, train/fp8.py swaps the decoder's linears in place
    transformer_engine train/te.py rebuilds the decoder layers from TE modules (GPU + Transformer Engine), FP8 through
                       te.autocast with the recipe of --fp8-recipe

Either way the parameters keep their canonical names, so loading and saving are unchanged; the FP8 delayed-scaling
state goes into train_state.json under "fp8" (JSON, base64 float32, keyed by module name and tensor role).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from checkpoint.config import ModelConfig
from train import fp8 as fp8_mod
from train import te as te_mod
from train.config import RunConfig
from train.parallel.groups import Groups


@dataclass
class Backend:
    impl: str  # local | transformer_engine
    fp8: fp8_mod.Float8Training | None = None  # local FP8
    te: Any = None  # te_mod.TEBackend

    def wrap(self, step):
        """The stage's micro-batch step, run under TE's autocast when the TE backend does FP8."""
        return self.te.wrap(step) if self.te is not None else step

    def after_backward(self) -> None:
        """Once per optimizer step, after every micro-batch's backward (delayed scaling's amax/scale update)."""
        if self.fp8 is not None:
            self.fp8.step()

    def state_dict(self, groups: Groups) -> dict | None:
        """The FP8 scaling state of the whole model (a collective: call it on every rank)."""
        if self.fp8 is not None:
            return fp8_mod.gather_state(self.fp8, groups)
        if self.te is not None:
            return self.te.gather_state(groups)
        return None

    def load_state_dict(self, sd: dict | None, where: Path) -> None:
        if sd is None:
            return  # a checkpoint trained without delayed scaling: start from TE's initial state (scale 1)
        if self.fp8 is not None:
            self.fp8.load_state_dict(sd, str(where))
        elif self.te is not None:
            self.te.load_state_dict(sd, str(where))

    def describe(self) -> str:
        if self.te is not None:
            return self.te.describe()
        if self.fp8 is not None:
            return f"backend local; {self.fp8.describe()}"
        return "backend local"


def setup(model: nn.Module, model_cfg: ModelConfig, groups: Groups, run: RunConfig, fp8: fp8_mod.FP8Config,
          cp_comm_type: str, sequence_parallel: bool) -> Backend:
    """Apply --transformer-impl and the FP8 flags to a freshly built stage (on its device)."""
    device = next(model.parameters()).device
    impl = te_mod.resolve_impl(run.transformer_impl, device,
                               why_not=te_mod.unsupported(model_cfg, fp8, run.recompute_granularity))
    if impl == "transformer_engine":
        return Backend(impl, te=te_mod.TEBackend.build(model, model_cfg, groups, fp8, sequence_parallel,
                                                       run.recompute_granularity, cp_comm_type))
    if not fp8.enabled:
        return Backend(impl)
    group = None
    if fp8.fp8_recipe == "delayed" and groups.dims.world > 1:
        group = fp8_mod.amax_reduction_group(groups.dims, groups.pp_rank)
    f = fp8_mod.Float8Training(fp8, model_cfg.num_layers, group)
    f.convert(model)
    return Backend(impl, fp8=f)
