"""torchtitan <-> shardkit (issue 39), against torchtitan's own model class and checkpointer on the CPU.

A tiny GQA Llama 3 is built from torchtitan's own config builders (Llama3Model, ComplexRoPE with Llama 3.1 scaling)
and saved by torchtitan's CheckpointManager (model-only, as its last step saves); then:

- torchtitan-to-mcore (at tp=2) and mcore-to-hf: transformers' forward on the export equals torchtitan's forward on
  its own weights within 1e-5 (fp32), which checks the Q/K RoPE row permutation and the rope scaling too;
- mcore-to-torchtitan: every tensor bitwise equal to what torchtitan saved, and torchtitan's CheckpointManager loads
  it (initial_load_path, model-only) into a fresh model whose forward equals the original bitwise;
- a full training checkpoint (AdamW, lr_scheduler, dataloader) converts at tp=2 pp=2 to the same weights and, with
  --optimizer, a native training checkpoint: each Adam moment element where its weight element is (moments set to
  2w and w*w in torchtitan, the fused wqkv's included), train_state.json with torchtitan's step;
- mcore-to-torchtitan --optimizer gives back that full checkpoint's every tensor bitwise (the fused wqkv's moments
  assembled); reshard takes the torchtitan folder straight to tp2/pp2; verify --against-torchtitan passes on the same
  weights and fails, naming tensors, on another model's;
- DeepSeek-V3 (test_deepseek_v3_against_torchtitan): names against torchtitan's own HF adapter, forward against
  torchtitan's and transformers', weights and the full training checkpoint both ways, torchtitan resuming it;
- a tied model (torchtitan's 1B/3B: both keys saved) round-trips bitwise;
- the flavour registry: `8B` gives Meta's published Llama-3-8B shape; a wrong flavour is one line.

The torchtitan side runs in its own interpreter (its import registers torch safe globals and loggers the rest of
the suite must not see). torchtitan 0.3 imports triton (GPU kernels, unused on the CPU): where either is missing the
tests skip, saying so.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from checkpoint.torch_dist import TorchDistCheckpoint
from shardkit.cli import main

TOL = 1e-5

_MISSING = [m for m in ("torchtitan", "triton") if importlib.util.find_spec(m) is None]
pytestmark = pytest.mark.skipif(bool(_MISSING), reason=f"not installed: {', '.join(_MISSING)} (torchtitan 0.3 "
                                "imports triton; `make install` installs both, see pyproject.toml's test extra)")

# torchtitan's side. Its flex attention is torch.compile'd at class level (minutes of inductor on the CPU); the eager
# flex_attention computes the same attention.
PRELUDE = textwrap.dedent("""
    import json, sys
    import numpy as np
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common.attention import FlexAttention
    FlexAttention._compiled_flex_attn = flex_attention
    from torchtitan.models.llama3 import _build_llama3_layers, Llama3Model
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.components.checkpoint import CheckpointManager

    def tiny(tied=False):
        dim, vocab = 64, 256
        return Llama3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=tied,
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
            norm=RMSNorm.Config(normalized_shape=dim), lm_head=Linear.Config(in_features=dim, out_features=vocab),
            layers=_build_llama3_layers(n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, hidden_dim=160,
                                        rope=ComplexRoPE.Config(dim=16, max_seq_len=256, theta=500000,
                                                                scaling="llama", original_max_position_embeddings=32),
                                        attn_backend="flex"))

    def forward(model, tokens):
        b, s = tokens.shape
        mask = create_block_mask(lambda b, h, q, k: q >= k, b, None, s, s, device="cpu")
        with torch.no_grad():
            return model(tokens, torch.arange(s).expand(b, s), mask)

    def manager(model, folder, **kw):
        cfg = CheckpointManager.Config(enable=True, folder=folder, keep_latest_k=0, **kw)
        return CheckpointManager(cfg, dataloader=None, model_parts=[model], optimizers=None, lr_schedulers=None,
                                 states={}, sd_adapter=None)
""")

SAVE = PRELUDE + textwrap.dedent("""
    from checkpoint.errors import ConfigError
    from convert.torchtitan import hf_config_of, hf_row_source, model_config
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    import os
    out = sys.argv[1]
    torch.manual_seed(0)
    cfg = tiny()
    model = cfg.build()
    model.init_states()
    with torch.no_grad():  # norms away from 1, so a swapped norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    manager(model, out + "/tt", last_save_model_only=True, export_dtype="float32").save(5, last_step=True)
    # a full training checkpoint too: AdamW moments (created by torchtitan's zero step), lr_scheduler, dataloader
    from torchtitan.components.optimizer.optimizer import default_adamw
    opt = default_adamw(implementation="for-loop").build(model_parts=[model])
    opt.state_dict()  # torchtitan's zero step creates the states; then moments that show where each element goes
    for o in opt.optimizers:
        for p, st in o.state.items():
            st["exp_avg"].copy_(2 * p.detach())
            st["exp_avg_sq"].copy_(p.detach() * p.detach())
            st["step"].fill_(7)
    cfg_full = CheckpointManager.Config(enable=True, folder=out + "/full", keep_latest_k=0, last_save_model_only=False)
    CheckpointManager(cfg_full, dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=None, states={},
                      sd_adapter=None).save(6, last_step=True)
    tied = tiny(tied=True).build()  # torchtitan's 1B/3B tie the head to the embedding (both keys saved)
    tied.init_states()
    assert tied.lm_head.weight is tied.tok_embeddings.weight
    manager(tied, out + "/tied", last_save_model_only=True, export_dtype="float32").save(2, last_step=True)
    os.makedirs(out + "/tiedcfg")
    json.dump(hf_config_of(tiny(tied=True)), open(out + "/tiedcfg/config.json", "w"))
    tokens = torch.randint(0, 256, (2, 12))
    np.save(out + "/tokens.npy", tokens.numpy())
    np.save(out + "/logits.npy", forward(model, tokens).numpy())
    os.makedirs(out + "/hfcfg")
    json.dump(hf_config_of(cfg), open(out + "/hfcfg/config.json", "w"))
    # the row permutation is torchtitan's own HF adapter's
    w = torch.arange(4 * 16 * 3, dtype=torch.float32).reshape(4 * 16, 3)
    ours = w.reshape(4, 16, 3)[:, torch.from_numpy(hf_row_source(16))].reshape(64, 3)
    assert torch.equal(Llama3StateDictAdapter._permute(None, w, 4), ours)
    # the registry's 8B: Meta's published Llama-3.1-8B shape
    c = model_config(flavor="8B")
    assert (c.hidden_size, c.ffn_hidden_size, c.num_layers, c.num_attention_heads, c.num_query_groups,
            c.vocab_size, c.rotary_base, c.rope_scaling["rope_type"], c.rope_scaling["factor"],
            c.tie_word_embeddings) == (4096, 14336, 32, 32, 8, 128256, 500000.0, "llama3", 8.0, False), c
    open(out + "/job.toml", "w").write('[model]\\nname = "llama3"\\nflavor = "8B"\\n')  # torchtitan <= 0.2's job config
    assert model_config(job_config=out + "/job.toml") == c
    # the registry's DeepSeek-V3 671B: deepseek-ai/DeepSeek-V3's published config.json
    d = model_config(flavor="671B", name="deepseek_v3")
    assert (d.hidden_size, d.ffn_hidden_size, d.moe_ffn_hidden_size, d.num_layers, d.num_attention_heads,
            d.num_moe_experts, d.moe_shared_expert_intermediate_size, d.moe_router_topk, d.moe_layer_freq[:4],
            d.moe_router_num_groups, d.moe_router_group_topk, d.moe_router_topk_scaling_factor,
            d.moe_router_norm_topk, d.moe_router_score_function, d.moe_router_enable_expert_bias, d.q_lora_rank,
            d.kv_lora_rank, d.qk_head_dim, d.qk_pos_emb_head_dim, d.v_head_dim, d.vocab_size, d.rotary_base,
            d.rope_scaling["factor"], d.rope_scaling["original_max_position_embeddings"],
            d.rope_scaling["mscale_all_dim"]) == (
        7168, 18432, 2048, 61, 128, 256, 2048, 8, [0, 0, 0, 1], 8, 4, 2.5, True, "sigmoid", True, 1536, 512, 128,
        64, 128, 129280, 10000.0, 40.0, 4096, 1.0), d
    try:
        model_config(flavor="nosuch")
        raise AssertionError("a wrong flavour was taken")
    except ConfigError as e:
        assert "has no such flavour; it has debugmodel, 1B" in str(e), e
    print("saved")
""")

LOAD = PRELUDE + textwrap.dedent("""
    out = sys.argv[1]
    torch.manual_seed(1)
    model = tiny().build()
    model.init_states()
    m = manager(model, out + "/unused", initial_load_path=out + "/back/step-5", initial_load_model_only=True)
    assert m.load(), "CheckpointManager loaded nothing"
    tokens = torch.from_numpy(np.load(out + "/tokens.npy"))
    assert np.array_equal(forward(model, tokens).numpy(), np.load(out + "/logits.npy"))
    print("loaded")
""")


def _torchtitan(script: str, out, *args: str) -> None:
    r = subprocess.run([sys.executable, "-c", script, str(out), *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """torchtitan's saves for both tests, made in one interpreter (torchtitan's import is most of its cost)."""
    root = tmp_path_factory.mktemp("torchtitan")
    for d in ("llama", "dsv3"):
        (root / d).mkdir()
    both = (f"import sys\nroot = sys.argv[1]\nsys.argv[1:] = [root + '/llama']\nexec(compile({SAVE!r}, 'save', 'exec'))"
            f"\nsys.argv[1:] = [root + '/dsv3']\nexec(compile({DSV3!r}, 'dsv3', 'exec'))\n")
    _torchtitan(both, root)
    return root


def test_torchtitan_round_trip_and_forward(saved, capsys):
    tmp_path = saved / "llama"
    tt = tmp_path / "tt"
    assert main(["convert", "torchtitan-to-mcore", str(tt), str(tmp_path / "native"), "--hf-config",
                 str(tmp_path / "hfcfg"), "--tp", "2", "--quiet"]) == 0
    assert (tmp_path / "native" / "iter_0000005").is_dir()
    assert main(["convert", "mcore-to-hf", str(tmp_path / "native"), str(tmp_path / "hf"), "--quiet"]) == 0
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", torch_dtype=torch.float32).eval()
    tokens = torch.from_numpy(np.load(tmp_path / "tokens.npy"))
    with torch.no_grad():
        logits = hf(tokens).logits.numpy()
    diff = np.abs(logits - np.load(tmp_path / "logits.npy")).max()
    assert diff <= TOL, diff

    assert main(["convert", "mcore-to-torchtitan", str(tmp_path / "native"), str(tmp_path / "back"),
                 "--quiet"]) == 0
    a = TorchDistCheckpoint(tt / "step-5", megatron=False)
    b = TorchDistCheckpoint(tmp_path / "back" / "step-5", megatron=False)
    assert set(a.tensors) == set(b.tensors) and len(a.tensors) == 2 + 2 * 9 + 1
    for name, t in a.tensors.items():
        assert b.tensors[name].dtype == t.dtype
        assert np.array_equal(a.read_numpy(name), b.read_numpy(name)), name
    _torchtitan(LOAD, tmp_path)
    # --overwrite replaces our files and leaves the user's
    (tmp_path / "back" / "step-5" / "notes.txt").write_text("mine")
    assert main(["convert", "mcore-to-torchtitan", str(tmp_path / "native"), str(tmp_path / "back"), "--quiet"]) == 1
    assert main(["convert", "mcore-to-torchtitan", str(tmp_path / "native"), str(tmp_path / "back"), "--quiet",
                 "--overwrite"]) == 0
    assert (tmp_path / "back" / "step-5" / "notes.txt").read_text() == "mine"
    assert not list((tmp_path / "back").glob(".step-*"))
    c = TorchDistCheckpoint(tmp_path / "back" / "step-5", megatron=False)
    assert all(np.array_equal(a.read_numpy(n), c.read_numpy(n)) for n in a.tensors)
    # tied: stored once (the head is checked equal to the embedding), both keys written back
    assert main(["convert", "torchtitan-to-mcore", str(tmp_path / "tied"), str(tmp_path / "ntied"), "--hf-config",
                 str(tmp_path / "tiedcfg"), "--tp", "2", "--quiet"]) == 0
    assert main(["convert", "mcore-to-torchtitan", str(tmp_path / "ntied"), str(tmp_path / "btied"), "--quiet"]) == 0
    a, b = (TorchDistCheckpoint(p / "step-2", megatron=False) for p in (tmp_path / "tied", tmp_path / "btied"))
    assert set(a.tensors) == set(b.tensors) and "lm_head.weight" in a.tensors
    assert all(np.array_equal(a.read_numpy(n), b.read_numpy(n)) for n in a.tensors)
    # read back with no flags (the config.json written beside), bitwise the same native checkpoint
    assert main(["convert", "torchtitan-to-mcore", str(tmp_path / "back"), str(tmp_path / "native2"), "--tp", "2",
                 "--quiet"]) == 0
    from checkpoint.reader import Checkpoint

    # the full training checkpoint: the same weights, and with --optimizer its AdamW moments; what is left is named
    assert main(["convert", "torchtitan-to-mcore", str(tmp_path / "full"), str(tmp_path / "native3"), "--hf-config",
                 str(tmp_path / "hfcfg"), "--tp", "2", "--pp", "2", "--optimizer", "--global-batch-size", "4"]) == 0
    assert "training-state entries (dataloader, lr_scheduler) are not converted" in capsys.readouterr().err
    x, y, z = (Checkpoint(tmp_path / n) for n in ("native", "native2", "native3"))
    assert z.manifest.iteration == 6 and z.manifest.provenance["source"]["not_converted"] == {
        "optimizer": 0, "lr_scheduler": 1, "dataloader": 1, "train_state": 0}  # (this save has neither: None)
    state = json.loads((z.path / "train_state.json").read_text())
    assert {k: state[k] for k in ("iteration", "consumed_samples", "optimizer_steps")} == {
        "iteration": 6, "consumed_samples": 24, "optimizer_steps": 7}
    assert [len(g["params"]) for g in state["torchtitan"]["param_groups"]] == [2 + 2 * 7 + 1]  # (wqkv: one each)
    assert z.manifest.optimizer == ["fp32_param", "exp_avg", "exp_avg_sq"]
    z.verify()
    from checkpoint.sharding import optimizer_key

    v = z.config.vocab_size
    for name in x.manifest.tensors:
        w = x.read(name)
        assert torch.equal(w, y.read(name)), name
        assert torch.equal(w, z.read(name)), name
        # each moment element sits where its weight element does (the fused wqkv's q/k/v rows and RoPE layout too)
        m1, m2 = (z.read(optimizer_key(st, name)) for st in ("exp_avg", "exp_avg_sq"))
        real = slice(0, v) if name in ("embedding.word_embeddings.weight", "output_layer.weight") else slice(None)
        assert torch.equal(m1[real], 2 * w[real]) and torch.equal(m2[real], w[real] * w[real]), name
        assert torch.equal(z.read(optimizer_key("fp32_param", name)), w), name
    # back to torchtitan's full training checkpoint: every tensor of its save bitwise (the fused wqkv's moments
    # assembled from q/k/v, the RoPE rows permuted back), its param groups' values; a weights-only one is refused
    assert main(["convert", "mcore-to-torchtitan", str(tmp_path / "native3"), str(tmp_path / "back3"), "--optimizer",
                 "--quiet"]) == 0
    a, b = (TorchDistCheckpoint(p / "step-6", megatron=False) for p in (tmp_path / "full", tmp_path / "back3"))
    assert set(a.tensors) == set(b.tensors) and "optimizer.state.layers.1.attention.qkv_linear.wqkv.weight.exp_avg" \
        in a.tensors
    assert all(np.array_equal(a.read_numpy(n), b.read_numpy(n)) for n in a.tensors)
    assert {n for n in a.objects if n.startswith("optimizer.")} == {n for n in b.objects if n.startswith("optimizer.")}
    capsys.readouterr()
    assert main(["convert", "mcore-to-torchtitan", str(tmp_path / "native"), str(tmp_path / "back4"), "--optimizer",
                 "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no AdamW state" in err and not (tmp_path / "back4").exists(), err

    # torchtitan as reshard's source (straight into tp2/pp2) and as verify's reference (every weight, values equal)
    assert main(["reshard", str(tt), str(tmp_path / "rs"), "--hf-config", str(tmp_path / "hfcfg"), "--tp", "2",
                 "--pp", "2", "--quiet"]) == 0
    r = Checkpoint(tmp_path / "rs")
    assert (r.layout.tp, r.layout.pp) == (2, 2)
    assert all(torch.equal(x.read(n), r.read(n)) for n in x.manifest.tensors)
    capsys.readouterr()
    assert main(["reshard", str(tt), str(tmp_path / "rs2"), "--tp", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not describe its model: pass --hf-config" in err, err
    assert main(["verify", str(tmp_path / "rs"), "--against-torchtitan", str(tmp_path / "full")]) == 0
    assert "OK: 21 tensors" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "rs"), "--against-torchtitan", str(tmp_path / "tied")]) == 1  # other values
    out = capsys.readouterr().out
    assert "FAIL model.layers.1.self_attn.q_proj.weight: differs" in out and "FAILED: 21 tensors" in out, out
    assert main(["verify", str(tmp_path / "rs"), "--against-torchtitan", str(tt), "--against", str(tt)]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_missing_config_is_one_line(tmp_path, capsys):
    (tmp_path / "step-1").mkdir()
    assert main(["convert", "torchtitan-to-mcore", str(tmp_path), str(tmp_path / "o")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a torchtitan checkpoint: no .metadata" in err, err
    from checkpoint.errors import ConfigError
    from convert.torchtitan import model_config

    with pytest.raises(ConfigError, match="pass one of --model-flavor FLAVOR"):
        model_config()
    (tmp_path / "job.toml").write_text('[model]\nname = "llama3"\n')
    assert main(["convert", "torchtitan-to-mcore", str(tmp_path), str(tmp_path / "o"), "--job-config",
                 str(tmp_path / "job.toml")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no [model] name and flavor" in err, err
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(
        {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}))
    assert main(["convert", "torchtitan-to-mcore", str(tmp_path), str(tmp_path / "o"), "--hf-config",
                 str(tmp_path / "cfg")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a torchtitan checkpoint" in err, err
    # a .metadata that would run code (DCP's own FileSystemReader.read_metadata is a bare pickle.load): refused
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'MARKER'}",))

    (tmp_path / "step-1" / ".metadata").write_bytes(pickle.dumps(Payload()))
    assert main(["convert", "torchtitan-to-mcore", str(tmp_path), str(tmp_path / "o"), "--hf-config",
                 str(tmp_path / "cfg")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing to unpickle" in err and "system" in err, err
    assert not (tmp_path / "MARKER").exists() and not (tmp_path / "o").exists()


DSV3 = textwrap.dedent("""
    import json, sys
    import torch
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torchtitan.models.common.attention import FlexAttention
    FlexAttention._compiled_flex_attn = flex_attention
    from torchtitan.models.common.moe import GroupedExperts

    def experts_fp32(self, x_RD, num_tokens_per_expert_E):  # the same math as its grouped GEMM, kept in fp32
        out, start = [], 0
        for e, n in enumerate(num_tokens_per_expert_E.tolist()):
            x = x_RD[start:start + n]
            start += n
            out.append((F.silu(x @ self.w1_EFD[e].T) * (x @ self.w3_EFD[e].T)) @ self.w2_EDF[e].T)
        return torch.cat(out)
    GroupedExperts.forward = experts_fp32
    from torchtitan.models.deepseek_v3 import DeepSeekV3Model, _build_dsv3_layers, _build_mtp_layers
    from torchtitan.models.deepseek_v3.state_dict_adapter import DeepSeekV3StateDictAdapter
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    out = sys.argv[1]
    dim, vocab = 64, 256
    layers = _build_dsv3_layers(
        n_layers=3, n_dense_layers=1, dim=dim, n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, mscale=1.0, dense_hidden_dim=128, moe_hidden_dim=32, num_experts=4,
        num_shared_experts=1, router_top_k=2, router_score_func="sigmoid", router_num_expert_groups=2,
        router_num_limited_groups=1, router_route_scale=2.5, router_route_norm=True, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=8, max_seq_len=512, theta=10000.0, scaling="yarn", rope_factor=4.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=128))
    for layer in layers:  # DeepSeek-V3's (and HF's) eps of the MLA latent norms; torchtitan 0.3 builds 1e-5
        layer.attention.q_norm.eps = layer.attention.kv_norm.eps = 1e-6
    cfg = DeepSeekV3Model.Config(
        vocab_size=vocab, dim=dim, tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim), lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=layers, mtp_layers=_build_mtp_layers(layers[-1], dim=dim, num_mtp_layers=1))

    class TrainState:
        def __init__(self, step=0, ntokens_seen=0):
            self.step, self.ntokens_seen = step, ntokens_seen
        def state_dict(self):
            return {"step": self.step, "ntokens_seen": self.ntokens_seen}
        def load_state_dict(self, sd):
            self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]

    def trainer(seed):  # model, AdamW, its LR schedule, train state: what torchtitan's trainer checkpoints
        torch.manual_seed(seed)
        model = cfg.build()
        model.init_states()
        oc = default_adamw(lr=3e-4)
        oc.implementation = "for-loop"
        opt = oc.build(model_parts=[model])
        return model, opt, LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opt, training_steps=10)

    def manager(folder, model, opt=None, sch=None, ts=None, **kw):
        c = CheckpointManager.Config(enable=True, folder=folder, keep_latest_k=0, **kw)
        return CheckpointManager(c, dataloader=None, model_parts=[model], optimizers=opt, lr_schedulers=sch,
                                 states={} if ts is None else {"train_state": ts}, sd_adapter=None)

    if sys.argv[2:3] == ["resume"]:  # continue-pretrain's own save, converted: torchtitan loads it and steps on
        model, opt, sch = trainer(5)
        ts = TrainState()
        assert manager(out + "/unused", model, opt, sch, ts, initial_load_path=sys.argv[3],
                       initial_load_model_only=False, exclude_from_loading=["dataloader"]).load()
        assert (ts.step, ts.ntokens_seen, sch.schedulers[0].last_epoch) == (8, 8 * 4 * 16, 8), ts.state_dict()
        groups = opt.optimizers[0].param_groups
        assert groups[0]["initial_lr"] == 3e-4 and groups[0]["weight_decay"] == 0.01, groups[0]
        states = list(opt.optimizers[0].state.values())
        assert all(float(st["step"]) == 9 and st["exp_avg_sq"].min() >= 0 and st["exp_avg_sq"].any() for st in states)
        before = [p.detach().clone() for p in model.parameters()]
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        print("resumed")
        sys.exit(0)
    if sys.argv[2:] == ["load"]:  # torchtitan's CheckpointManager loads what mcore-to-torchtitan wrote
        torch.manual_seed(1)
        model = cfg.build()
        model.init_states()
        assert manager(out + "/unused", model, initial_load_path=out + "/back/step-3",
                       initial_load_model_only=True).load()
        want = torch.load(out + "/sd.pt", weights_only=True)
        got = model.state_dict()
        assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
        # the full training checkpoint: loaded (no dataloader entry: excluded) and resumed exactly as torchtitan's
        runs = []
        for src, seed in (("/full/step-6", 2), ("/back_full/step-6", 3)):
            model, opt, sch = trainer(seed)
            ts = TrainState()
            assert manager(out + "/unused", model, opt, sch, ts, initial_load_path=out + src,
                           initial_load_model_only=False, exclude_from_loading=["dataloader"]).load(), src
            assert (ts.step, ts.ntokens_seen, sch.schedulers[0].last_epoch) == (6, 1234, 6), src
            runs.append((model, opt, sch, opt.state_dict()))
        a, b = runs[0][3], runs[1][3]
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                        for k in a), [k for k in a if not torch.is_tensor(a[k]) and a[k] != b[k]]
        for model, opt, sch, _ in runs:  # one step with the same gradients
            torch.manual_seed(4)
            for p in model.parameters():
                p.grad = torch.randn_like(p)
            opt.step()
            sch.step()
        pa, pb = (dict(r[0].named_parameters()) for r in runs)
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
        assert all(torch.equal(x, y) for x, y in zip(runs[0][1].state_dict().values(), runs[1][1].state_dict().values())
                   if torch.is_tensor(x))
        print("loaded")
        sys.exit(0)
    model, opt, sch = trainer(0)
    with torch.no_grad():  # every tensor distinct (norms and the expert bias too), at sizes that keep logits sane
        for n, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.is_floating_point():
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in n else 0.08 * torch.randn_like(p))
    manager(out + "/tt", model, last_save_model_only=True).save(3, last_step=True)
    # torchtitan's own HF mapping of the same weights: the oracle for names, expert split and MTP placement
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(sd, out + "/sd.pt")
    save_file(DeepSeekV3StateDictAdapter(cfg, None).to_hf(sd), out + "/oracle.safetensors")
    tokens = torch.randint(0, vocab, (2, 12))
    mask = create_block_mask(lambda b, h, q, k: q >= k, 2, None, 12, 12, device="cpu")
    with torch.no_grad():
        torch.save({"tokens": tokens, "logits": model(tokens, torch.arange(12).expand(2, 12), mask)[0]},
                   out + "/forward.pt")
    # a full training checkpoint: AdamW moments that show where each element goes, the schedule at step 6
    opt.state_dict()  # torchtitan's zero step creates the states
    for o in opt.optimizers:
        for p, st in o.state.items():
            st["exp_avg"].copy_(2 * p.detach())
            st["exp_avg_sq"].copy_(p.detach() * p.detach())
            st["step"].fill_(7)
    for _ in range(6):
        sch.step()
    manager(out + "/full", model, opt, sch, TrainState(6, 1234), last_save_model_only=False).save(6, last_step=True)
    import os
    os.makedirs(out + "/hfcfg")
    json.dump({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": vocab,
               "hidden_size": dim, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
               "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
               "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
               "routed_scaling_factor": 2.5, "norm_topk_prob": True, "topk_method": "noaux_tc",
               "scoring_func": "sigmoid", "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
               "qk_rope_head_dim": 8, "v_head_dim": 16, "num_nextn_predict_layers": 1,
               "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
               "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                                "original_max_position_embeddings": 128, "mscale": 1.0, "mscale_all_dim": 1.0},
               "tie_word_embeddings": False, "torch_dtype": "float32"}, open(out + "/hfcfg/config.json", "w"))
    print("saved")
""")


def test_deepseek_v3_against_torchtitan(saved, capsys):
    """DeepSeek-V3 (MLA with q LoRA, routed experts stacked in torchtitan, shared experts, expert bias, an MTP
    layer): torchtitan-to-mcore at tp2/ep2, then mcore-to-hf, equals torchtitan's own DeepSeekV3StateDictAdapter.to_hf
    of the same weights, tensor for tensor, bitwise; torchtitan's forward equals ours (train/model.py) and
    transformers' on the converted weights within 1e-5 (fp32; torchtitan's experts' grouped GEMM, bf16 by design, is
    replaced by the same math in fp32); mcore-to-torchtitan gives back torchtitan's save bitwise, and torchtitan's
    CheckpointManager loads it into a fresh model (the experts as one DCP chunk each) exactly. The full training
    checkpoint (AdamW, LR schedule at step 6, train_state): --optimizer both ways puts each moment element where its
    weight element is (2w, w*w; the expert bias, a buffer, has zeros), gives back every tensor bitwise, and torchtitan
    loads it (dataloader excluded: named in a note) and takes the same next step as from its own save."""
    tmp_path = saved / "dsv3"
    assert main(["convert", "torchtitan-to-mcore", str(tmp_path / "tt"), str(tmp_path / "native"), "--hf-config",
                 str(tmp_path / "hfcfg"), "--tp", "2", "--ep", "2", "--quiet"]) == 0
    assert main(["convert", "mcore-to-hf", str(tmp_path / "native"), str(tmp_path / "hf"), "--quiet"]) == 0
    from safetensors import safe_open

    ours = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(f, "pt") as g:
            ours.update({k: g.get_tensor(k) for k in g.keys()})
    with safe_open(tmp_path / "oracle.safetensors", "pt") as g:
        oracle = {k: g.get_tensor(k) for k in g.keys()}
    assert "model.layers.3.eh_proj.weight" in oracle and "model.layers.1.mlp.experts.3.down_proj.weight" in oracle
    # ours adds the MTP layer's copies of the embedding and head (HF's layout; Megatron shares them)
    assert set(oracle) == set(ours) - {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    for k, v in oracle.items():
        assert torch.equal(ours[k], v), k
    # the forward: torchtitan's logits vs ours and transformers' on the converted weights
    import transformers

    from checkpoint.reader import Checkpoint
    from train.model import GPTModel

    fw = torch.load(tmp_path / "forward.pt", weights_only=True)
    tokens, want = fw["tokens"], fw["logits"]
    assert want.std() > 0.1, "logits too small for the comparison to mean anything"
    ck = Checkpoint(tmp_path / "native")
    canonical = {n: ck.read(n) for n in ck.manifest.tensors}
    model = GPTModel(ck.config, canonical["embedding.word_embeddings.weight"].shape[0])
    model.load_canonical(canonical)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        mine = model.eval()(tokens)[..., :want.shape[-1]]
        theirs = hf(tokens, use_cache=False).logits
    assert (mine - want).abs().max() <= TOL and (theirs - want).abs().max() <= TOL, \
        ((mine - want).abs().max(), (theirs - want).abs().max())
    # and back: every tensor of torchtitan's own save, bitwise (the experts as one chunk each)
    assert main(["convert", "mcore-to-torchtitan", str(tmp_path / "native"), str(tmp_path / "back"), "--quiet"]) == 0
    a = TorchDistCheckpoint(tmp_path / "tt" / "step-3", megatron=False)
    b = TorchDistCheckpoint(tmp_path / "back" / "step-3", megatron=False)
    assert set(a.tensors) == set(b.tensors)
    for name in a.tensors:
        assert np.array_equal(a.read_numpy(name), b.read_numpy(name)), name
    assert main(["verify", str(tmp_path / "native"), "--against-torchtitan", str(tmp_path / "tt"), "--quiet"]) == 0
    # the full training checkpoint, both ways
    assert main(["convert", "torchtitan-to-mcore", str(tmp_path / "full"), str(tmp_path / "nfull"), "--hf-config",
                 str(tmp_path / "hfcfg"), "--tp", "2", "--ep", "2", "--optimizer", "--global-batch-size", "4",
                 "--quiet"]) == 0
    z = Checkpoint(tmp_path / "nfull")
    z.verify()
    state = json.loads((z.path / "train_state.json").read_text())
    assert state["optimizer_steps"] == 7 and state["torchtitan"]["train_state"] == {"step": 6, "ntokens_seen": 1234}
    assert state["torchtitan"]["lr_scheduler"] == {"last_epoch": 6}
    assert state["torchtitan"]["param_groups"][0]["initial_lr"] == 3e-4  # (its lr: the schedule's at step 6)
    from checkpoint.sharding import optimizer_key

    v = z.config.vocab_size
    for name in z.manifest.tensors:
        if name.startswith("optimizer."):
            continue
        w = z.read(name)
        assert torch.equal(w, ck.read(name)), name
        m1, m2 = (z.read(optimizer_key(st, name)) for st in ("exp_avg", "exp_avg_sq"))
        real = (slice(0, v),) if "word_embeddings" in name or "output_layer" in name else (slice(None),)
        if name.endswith("router.expert_bias"):
            assert not m1.any() and not m2.any(), name
        else:
            assert torch.equal(m1[real], 2 * w[real]) and torch.equal(m2[real], w[real] * w[real]), name
        assert torch.equal(z.read(optimizer_key("fp32_param", name)), w), name
    capsys.readouterr()
    assert main(["convert", "mcore-to-torchtitan", str(tmp_path / "nfull"), str(tmp_path / "back_full"), "--optimizer",
                 "--quiet"]) == 0
    assert 'no dataloader entry' in capsys.readouterr().err
    a = TorchDistCheckpoint(tmp_path / "full" / "step-6", megatron=False)
    b = TorchDistCheckpoint(tmp_path / "back_full" / "step-6", megatron=False)
    assert set(a.tensors) == set(b.tensors) and any(".exp_avg_sq" in n for n in a.tensors)
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype, name
        assert np.array_equal(a.read_numpy(name), b.read_numpy(name)), name
    assert set(a.objects) - set(b.objects) == {"dataloader"}
    _torchtitan(DSV3, tmp_path, "load")


def test_deepseek_v3_training_through_continue_pretrain(saved, tmp_path):
    """torchtitan's DeepSeek-V3 training checkpoint -> ours (--optimizer) -> continue-pretrain 2 more iterations ->
    mcore-to-torchtitan --optimizer: torchtitan's CheckpointManager loads the trainer's own save (the Megatron param
    groups' AdamW settings, the trainer's step, the tokens seen from its sequence length) and takes a step."""
    from train.data.indexed import write_indexed

    src = saved / "dsv3"
    assert main(["convert", "torchtitan-to-mcore", str(src / "full"), str(tmp_path / "native"), "--hf-config",
                 str(src / "hfcfg"), "--optimizer", "--global-batch-size", "4", "--quiet"]) == 0
    rng = np.random.default_rng(0)
    write_indexed(tmp_path / "data", [rng.integers(3, 200, size=40) for _ in range(64)], np.uint16)
    assert main(["continue-pretrain", "--load", str(tmp_path / "native"), "--data-path", str(tmp_path / "data"),
                 "--save", str(tmp_path / "cp"), "--seq-length", "16", "--micro-batch-size", "1",
                 "--global-batch-size", "4", "--train-iters", "8", "--lr", "3e-4", "--weight-decay", "0.01"]) == 0
    assert main(["convert", "mcore-to-torchtitan", str(tmp_path / "cp"), str(tmp_path / "tt"), "--optimizer",
                 "--quiet"]) == 0
    _torchtitan(DSV3, tmp_path, "resume", str(tmp_path / "tt" / "step-8"))
