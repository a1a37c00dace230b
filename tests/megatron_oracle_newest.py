"""megatron-core 0.19.2 and Megatron-Bridge 0.6.2 on the CPU as the test oracle of shardkit's torch_dist writer (issue
41), run in the Python 3.12 environment scripts/oracle_env.sh builds (never in the test process):

    <oracle python> tests/megatron_oracle_newest.py TOPIC job.json

One job per process (Bridge's export sets up and tears down its own process group). Results go to job["out"]
(torch.save). Topics:

  load    {"ckpt", "model", "input_ids"[, "tampered"]}: megatron-core 0.19's dist_checkpointing.load of the
          checkpoint into its own GPTModel (megatron_oracle.build: local spec, TE key names mapped), with
          verify_integrity=True (its integrity.json checked by megatron-core's own verify_integrity_manifest): the
          model's tensors (global, by sharded key) and logits; "common_source": where load_common_state_dict found
          the common state; "args_config": the TransformerConfig Megatron-Bridge 0.6 builds from the args
          (mlm_compat `_transformer_config_from_args`, its fields or the error); "tampered": for each path there,
          the error verify_integrity_manifest raises (None where it passed).
  bridge  {"hf", "ckpt", "out_hf"}: Megatron-Bridge 0.6's AutoBridge.from_hf_pretrained(hf).export_ckpt(ckpt,
          out_hf), then its model_load_save.load_megatron_model(iteration dir) (weights by name).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.machinery
import json
import os
import pkgutil
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import megatron_oracle as mo  # noqa: E402  (the 0.16 oracle's model and CPU shims: same recipe)


def load(job: dict) -> dict:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import verify_integrity_manifest

    mo.init_megatron_cpu()
    it = Path(job["ckpt"])
    model = mo.build(job["model"])
    state = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(it), verify_integrity=True)
    model.load_state_dict(state["model"], strict=True)
    common_source = "common.pt" if (it / "common.pt").exists() else "dcp item"
    common = dist_checkpointing.load_common_state_dict(str(it))
    out = {"tensors": mo.global_tensors(model), "logits": mo.logits(model, torch.load(job["input_ids"])),
           "common_source": common_source, "iteration": common.get("iteration"),
           "args_config": _bridge_args_config(common["args"]),
           # the same args with megatron-core 0.16's defaults of the two deprecated SM counts (what shardkit wrote
           # before): the oracle must refuse them
           "args_config_016_sms": _bridge_args_config(argparse.Namespace(**{
               **vars(common["args"]), "moe_deepep_num_sms": 20, "moe_hybridep_num_sms": 16}))}
    tampered = {}
    for p in job.get("tampered", []):
        try:
            verify_integrity_manifest(p)
            tampered[p] = None
        except Exception as e:  # recorded: the test names it
            tampered[p] = f"{type(e).__name__}: {e}"
    out["tampered"] = tampered
    return out


def _bridge_args_config(args) -> dict:
    """Megatron-Bridge's own reading of Megatron-LM args (0.19's TransformerConfig and its deprecation checks)."""
    _import_bridge()
    from megatron.bridge.training.mlm_compat.arguments import _transformer_config_from_args

    args = argparse.Namespace(**vars(args))
    args.apply_rope_fusion = False  # Megatron-LM's default needs Transformer Engine, which this CPU has not
    try:
        tc = _transformer_config_from_args(args)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}
    keep = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "layernorm_epsilon", "normalization", "gated_linear_unit", "add_bias_linear", "moe_flex_dispatcher_num_sms")
    return {k: getattr(tc, k) for k in keep if any(f.name == k for f in dataclasses.fields(tc))}


class _Stub(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name, (), {})


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Stub(name, (), {})


# what Megatron-Bridge imports at import time for features the oracle never uses (Transformer Engine's layers,
# Energon's multimodal data loaders), absent from the oracle environment
STUBBED = ("transformer_engine", "transformer_engine.pytorch", "megatron.energon")


def _import_bridge():
    """Megatron-Bridge 0.6 imports Transformer Engine at import time (its LoRA layers), which this CPU has not:
    megatron-core is imported whole first (so it decides "no TE" on its own), then inert stand-ins of
    `transformer_engine(.pytorch)` let Bridge's modules define their (never used) TE classes."""
    if "megatron.bridge" in sys.modules:
        return
    import megatron.core

    skip = ("megatron.core.inference", "megatron.core.post_training", "megatron.core.export",
            "megatron.core.resharding")
    for mi in pkgutil.walk_packages(megatron.core.__path__, "megatron.core."):
        if not mi.name.startswith(skip):
            try:
                importlib.import_module(mi.name)
            except Exception:  # modules for hardware or packages absent here
                pass
    for name in STUBBED:
        m = _StubModule(name)
        m.__spec__, m.__path__ = importlib.machinery.ModuleSpec(name, None), []
        sys.modules.setdefault(name, m)
    import megatron.bridge  # noqa: F401


def bridge(job: dict) -> dict:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    _import_bridge()
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.model_load_save import load_megatron_model

    b = AutoBridge.from_hf_pretrained(job["hf"])
    b.export_ckpt(job["ckpt"], job["out_hf"], show_progress=False)
    root = Path(job["ckpt"])
    its = sorted(root.glob("iter_*"))
    it = its[-1] if its else root
    sd = load_megatron_model(str(it), return_state_dict=True, use_cpu_init=True)
    return {"loaded": {k: v.detach().clone() for k, v in sd["model"].items() if torch.is_tensor(v)}}


TOPICS = {"load": load, "bridge": bridge}


def main() -> None:
    topic, path = sys.argv[1], sys.argv[2]
    job = json.loads(Path(path).read_text())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    out = TOPICS[topic](job)
    torch.save(out, job["out"])


if __name__ == "__main__":
    main()
