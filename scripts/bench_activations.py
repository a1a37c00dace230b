"""Saved activations per transformer layer, measured: the exact bytes autograd keeps for backward in one layer's
forward (bf16), both engines, at Llama-3-8B and Llama-3-70B widths, TP 1 and TP 2/8 with sequence parallelism,
against Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") (issue 40).

How it is measured. World = TP ranks spawned on gloo (torch.multiprocessing), the engines' real TP/SP collectives. Each
engine builds a one-layer model its own way: native, train/parallel/parallelize.py `parallelize` (local_config on the
meta device, materialised, apply_tensor_parallel, apply_recompute); megatron-core, its GPTModel with the local layer
spec from train/engines/megatron_core/'s `transformer_config` and RMSNorm (megatron-core on the CPU through the
engine's `cpu_stand_ins`). Weights random (normal, std 0.02). One layer's forward runs on a random bf16 input (this
rank's 1/TP of the sequence under SP) inside torch.autograd.graph.saved_tensors_hooks: every tensor handed to the pack
hook is counted by its storage, each storage once (views share it; the bytes are the storage's), leaving out the
parameters and what the layer is given from outside and shares with every other layer (RoPE cos/sin, the attention
mask). Non-reentrant torch.utils.checkpoint (native selective recompute) keeps its inputs by reference rather than
through the hooks: they are counted as the inputs of the recomputed call. Bytes are per rank.

Two sequence lengths s1 < s2 are measured (b = 1); bytes(s) = A*s + B*s^2 is solved from them (B: attention-score
sized terms, the s x s softmax) and scaled to --target-seq (4096). The native engine's SDPA keeps O(s) (the flash
kernel's output and log-sum-exp), so its B is 0; megatron-core's local spec keeps the softmax. (megatron-core's
recompute keeps one 4-byte tensor whatever s is: B is off by ~1e-5 byte there.) The full run (2 widths x 3 TPs x 2
engines x 2 recompute settings, s = 256 and 512) took under 3.5 minutes on this 2-core machine.

The formula (Korthikanti et al. Sec. 4, bf16, sequence parallel, per layer, a = heads, t = TP):

    paper, GPT layer          s*b*h*(34/t + 5*a*s/(h*t))          (selective recompute: s*b*h*34/t)

term by term (bytes per token, "what op keeps which tensor"):
    attention:  LayerNorm input 2h; QKV linear input 2h; Q and K for QK^T 4h; softmax output 2as (per query token),
                its dropout mask as and dropout output 2as (for the V matmul), V 2h; projection input 2h;
                dropout mask h                                               = 11h + 5as
    MLP:        LayerNorm input 2h; fc1 input 2h; GeLU input 8h (4h wide); fc2 input 8h; dropout mask h  = 19h + ...
                ... with the second LayerNorm                                = 21h; the layer 34h + 5as
    with SP every term is split over t (the norms and dropouts act on 1/t of the sequence, the linears keep their
    1/t-sequence input and gather it again in backward).

Where Llama's layer differs (the "Llama" column: what fused kernels keep, flash attention, selective = drop the
attention-score term):
    - RMSNorm: the same 2h input per norm (plus a per-token fp32 statistic, negligible);
    - no dropout (Llama trains without; megatron's 0 dropout keeps no mask): the two h masks and the s^2 mask and
      dropout output go, 5as -> 2as for the softmax output, which is also the V matmul's input;
    - GQA with g KV groups of head dim d = h/a: Q 2h, K and V 2h*g/a each (QKV output 2h*(1 + 2g/a));
    - SwiGLU with ffn F: fc1 output [gate; up] 4F (the swiglu kernel's saved input), fc2 input (the product) 2F:
      2h + 6F for the MLP, against GeLU's 2h + 16h (F = 4h); at Llama-3's F = 3.5h it is 2h + 21h;
    - flash attention keeps its output (already the projection input) and an fp32 log-sum-exp per head: 4a, no s^2.
    Llama layer = 2h + 2h + 2h(1 + 2g/a) + [2as | 4a] + 2h  +  2h + 2h + 6F, all over t.

What the eager engines keep instead (measured; the native list is exact, `native_bytes`, and tested):
    native (train/model.py on the CPU; flash-like SDPA, so the Llama column it is compared with is the flash one):
        RMSNorm in plain torch keeps an fp32 copy of its input and the bf16 normalised value besides the linear's
        input (8h + 4 per norm against 2h); SDPA keeps Q, K and V at their GQA widths, its output (a view the
        projection reads too) and the log-sum-exp; SwiGLU keeps silu(gate) besides [gate; up] and the product (8F);
        RoPE keeps only its cos/sin, shared by every layer.
    megatron-core, local spec (compared with the softmax column): torch.nn.RMSNorm keeps two fp32 copies (its input
        and the normalised value, 8h + 4 per norm); the unfused DotProductAttention expands K and V to every query head
        (GQA lost: 6h for Q, K^T, V) and keeps the fp32 softmax (4as) and its bf16 copy (2as); RoPE's cos/sin are made
        per layer (4 x 2d per token, not split over t); the GLU keeps silu(gate), the (up + offset) copy and the
        product besides [gate; up] (10F); under selective recompute the checkpoint keeps Q, K and V, and K and V keep
        the whole fused QKV output alive (views of it).
    On a GPU megatron-core runs Transformer Engine's spec (fused RMSNorm-linear, flash attention, fused SwiGLU), which
    is the Llama column's list; this CPU measurement covers the local spec only.

    .venv/bin/python scripts/bench_activations.py [--widths llama3-8b,llama3-70b] [--tp 1,2,8] [--seqs 256,512]
        [--engines native,megatron-core] [--recompute none,selective] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

WIDTHS = {  # the hub configs' widths (one layer; the vocabulary is irrelevant to a layer and kept tiny)
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "llama3-70b": dict(hidden_size=8192, intermediate_size=28672, num_attention_heads=64, num_key_value_heads=8),
}
ENGINES = ("native", "megatron-core")
BF16 = 2


def hf_config(width: dict) -> dict:
    return dict(model_type="llama", num_hidden_layers=1, vocab_size=256, max_position_embeddings=8192,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, hidden_act="silu", **width)


# -- the formulas ------------------------------------------------------------------------------------------------------

def paper_bytes(h: int, a: int, s: int, b: int, t: int, selective: bool) -> float:
    """Korthikanti et al.'s per-layer bytes (GPT layer, 16-bit, tensor + sequence parallel)."""
    return s * b * h * (34 / t + (0 if selective else 5 * a * s / (h * t)))


def llama_bytes(h: int, ffn: int, a: int, g: int, s: int, b: int, t: int, selective: bool,
                flash: bool = False) -> float:
    """The paper's list for Llama's layer (module docstring): RMSNorm, no dropout, GQA, SwiGLU; the score term is the
    softmax output (2as per token), or flash's fp32 log-sum-exp (4a); selective recompute drops it."""
    per_token = (2 * h + 2 * h + 2 * h * (1 + 2 * g / a) + 2 * h  # norm in, QKV in, Q/K/V, projection in
                 + 2 * h + 2 * h + 6 * ffn)  # norm in, fc1 in, [gate; up] and the product
    score = 0 if selective else (4 * a if flash else 2 * a * s)
    return s * b * (per_token + score) / t


def native_bytes(h: int, ffn: int, a: int, g: int, s: int, b: int, t: int, selective: bool) -> float:
    """What the native engine (train/model.py, plain torch autograd, CPU SDPA) keeps, tensor by tensor, per token:
        each RMSNorm (on the 1/t sequence slice): the fp32 copy of its input 4h (pow and the rsqrt product), the fp32
            rsqrt 4, the bf16 normalised value 2h (the weight product), its output 2h (the linear's input: under SP
            the local slice, comm.gathered_linear)                                          2 x (8h + 4)
        attention (all s tokens, a/t heads, g/t groups of head dim d = h/a): SDPA keeps Q 2h (after RoPE, which
            keeps only cos/sin), K and V 2h*g/a each (V a contiguous copy), its output 2h (the projection's input
            too: a view) and the fp32 log-sum-exp 4a (not under selective recompute, which keeps Q, K, V as the
            checkpoint's inputs and the output as the projection's input)                 4h + 4h*g/a + 4a
        SwiGLU MLP (all s tokens, F/t): fc1's output [gate; up] 4F, silu(gate) 2F, the product (fc2's input) 2F  8F
    all over t."""
    per_token = 2 * (8 * h + 4) + 4 * h + 4 * h * g / a + (0 if selective else 4 * a) + 8 * ffn
    return s * b * per_token / t


# -- the measurement ---------------------------------------------------------------------------------------------------

class SavedBytes:
    """saved_tensors_hooks that record each storage once (data pointer -> bytes, and a shape/dtype example), leaving
    out the `excluded` storages (parameters, inputs shared across layers)."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.seen: dict[int, tuple[int, str]] = {}

    def add(self, t) -> None:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.excluded and ptr not in self.seen:
            self.seen[ptr] = (st.nbytes(), f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}")

    def hooks(self):
        import torch

        def pack(t):
            self.add(t)
            return t

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(n for n, _ in self.seen.values())


def _storages(tensors) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def _init_(params) -> None:
    import torch

    with torch.no_grad():
        for p in params:
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(1.0)


def _native_layer(hf: dict, tp: int, world: int, sp: bool, recompute: str | None):
    """The native engine's one-layer model as the trainer builds it (parallelize), random weights: (model, its
    layer). A job at TP t < world runs as world / t data-parallel replicas."""
    import torch

    from checkpoint.config import ModelConfig
    from checkpoint.run_layout import RunLayout
    from train.config import ParallelConfig, RunConfig
    from train.parallel.groups import build_groups
    from train.parallelize import parallelize

    cfg = ModelConfig.from_hf(hf)
    groups = build_groups(RunLayout(tp=tp, dp=world // tp))
    par = parallelize(cfg, groups, torch.device("cpu"), torch.bfloat16, ParallelConfig(tp=tp, sequence_parallel=sp),
                      RunConfig(bf16=True, recompute_granularity=recompute, attention_dropout=0.0, hidden_dropout=0.0))
    model = par.model
    _init_(model.parameters())
    layer = model.decoder.layers["0"]
    return model, layer


def _measure_native(model, layer, s: int, b: int, tp: int, sp: bool, recompute: str | None) -> SavedBytes:
    import torch

    ids = torch.zeros(b, s, dtype=torch.long)
    cos, sin = model.rope(ids, None, torch.bfloat16)
    x = torch.randn(b, s // tp if sp else s, model.cfg.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    rec = SavedBytes(_storages(model.parameters()) | _storages([cos, sin]))
    att = layer.self_attention
    inner = att.core_attention
    if recompute == "selective":  # the checkpoint keeps its inputs by reference (not through the hooks)
        def core(q, k, v, mask):
            for t in (q, k, v):
                rec.add(t)
            return inner(q, k, v, mask)
        att.core_attention = core
    try:
        with rec.hooks():
            out = layer(x, cos, sin)
    finally:
        att.core_attention = inner
    return rec


def _megatron_layer(hf: dict, tp: int, world: int, sp: bool, recompute: str | None):
    """megatron-core's one-layer GPTModel (local spec) as the engine builds it (transformer_config, its RMSNorm)."""
    import torch

    from checkpoint.config import ModelConfig
    from checkpoint.run_layout import RunLayout
    from train.config import RunConfig
    from train.engines.megatron_core import config as mc_config, modules as mc_modules, runtime as mc_runtime

    mc_runtime.import_megatron()
    mc_runtime.cpu_stand_ins()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    if recompute:  # megatron-core's checkpoint saves the CUDA RNG state: the CPU's stands in (forward only here)
        tensor_parallel.random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        tensor_parallel.random._set_cuda_rng_state = lambda *a, **k: None
        tracker = tensor_parallel.get_cuda_rng_tracker()
        tracker.get_states = lambda: {}
        tracker.set_states = lambda states: None
    m = ModelConfig.from_hf(hf)
    dims = RunLayout(tp=tp, dp=world // tp)
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() != tp:
        ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    run = RunConfig(bf16=True, recompute_granularity=recompute, attention_dropout=0.0, hidden_dropout=0.0)
    tc = mc_config.transformer_config(m, dims, run, sp=sp, dtype=torch.bfloat16, on_cpu=True)
    tc.perform_initialization = False  # no fp32 master copy of each full weight per rank (70B's fc1: 1.9 GB)
    spec = get_gpt_decoder_block_spec(tc, use_transformer_engine=False, normalization="RMSNorm")
    spec.layer_norm = mc_modules.RMSNorm
    for ls in spec.layer_specs:
        ls.submodules.input_layernorm = ls.submodules.pre_mlp_layernorm = mc_modules.RMSNorm
    with mc_runtime.keep_pickle_allowlist():
        model = GPTModel(tc, spec, vocab_size=m.padded_vocab_size(tp), max_sequence_length=m.max_position_embeddings,
                         pre_process=True, post_process=True, position_embedding_type="rope", rotary_percent=1.0,
                         rotary_base=int(m.rotary_base))
    _init_(model.parameters())
    return model, model.decoder.layers[0]


def _measure_megatron(model, layer, s: int, b: int, tp: int, sp: bool, recompute: str | None) -> SavedBytes:
    import torch

    emb = model.rotary_pos_emb(s)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # the engine's causal mask
    x = torch.randn(s // tp if sp else s, b, model.config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    rec = SavedBytes(_storages(model.parameters()) | _storages([emb, mask]))
    with rec.hooks():
        out, _ = layer(hidden_states=x, attention_mask=mask, rotary_pos_emb=emb)
    return rec


def _worker(rank: int, world: int, port: int, jobs: list[dict], out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = []
    for job in jobs:  # one engine, one width, one recompute setting at a time; every length on the same layer
        torch.manual_seed(rank)
        sp = job["tp"] > 1
        build, measure = ((_native_layer, _measure_native) if job["engine"] == "native" else
                          (_megatron_layer, _measure_megatron))
        model, layer = build(job["hf"], job["tp"], world, sp, job["recompute"])
        for s in job["seqs"]:
            rec = measure(model, layer, s, job["b"], job["tp"], sp, job["recompute"])
            results.append({**{k: v for k, v in job.items() if k not in ("hf", "seqs")}, "s": s, "bytes": rec.total,
                            "tensors": sorted(rec.seen.values(), reverse=True)})
        del model, layer
    Path(out, f"{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def measure(jobs: list[dict], world: int) -> list[dict]:
    """Run `jobs` on `world` spawned ranks (a job at TP t < world: world / t data-parallel replicas); rank 0's rows
    (every rank's bytes checked equal)."""
    import torch.multiprocessing as mp

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, port, jobs, d), nprocs=world, start_method="spawn")
        ranks = [json.loads(Path(d, f"{r}.json").read_text()) for r in range(world)]
    for r, rows in enumerate(ranks[1:], 1):
        if [x["bytes"] for x in rows] != [x["bytes"] for x in ranks[0]]:
            raise RuntimeError(f"rank {r} saved other bytes than rank 0: {[x['bytes'] for x in rows]} vs "
                               f"{[x['bytes'] for x in ranks[0]]}")
    return ranks[0]


def fit(rows: list[dict]) -> tuple[float, float]:
    """bytes(s) = A*s + B*s^2 from two lengths (per micro-batch row b)."""
    (s1, y1), (s2, y2) = sorted((r["s"], r["bytes"]) for r in rows)[:2]
    B = (y2 / s2 - y1 / s1) / (s2 - s1)
    return y1 / s1 - B * s1, B


def table(widths: dict[str, dict], tps: list[int], seqs: list[int], engines: list[str], recomputes: list[str | None],
          target: int, b: int = 1) -> list[dict]:
    out = []
    for tp in tps:
        jobs = [dict(engine=e, width=w, hf=hf_config(widths[w]), tp=tp, seqs=seqs, b=b, recompute=r)
                for w in widths for e in engines for r in recomputes]
        rows = measure(jobs, tp)
        for job in jobs:
            mine = [r for r in rows if all(r[k] == job[k] for k in ("engine", "width", "recompute"))]
            A, B = fit(mine)
            wd = widths[job["width"]]
            h, a, g, F = (wd["hidden_size"], wd["num_attention_heads"], wd["num_key_value_heads"],
                          wd["intermediate_size"])
            sel = job["recompute"] == "selective"
            measured = b * (A * target + B * target ** 2)
            out.append({"engine": job["engine"], "width": job["width"], "tp": tp, "sp": tp > 1,
                        "recompute": job["recompute"] or "none", "seq": target, "micro_batch": b,
                        "measured_seqs": {r["s"]: r["bytes"] for r in mine}, "bytes_per_token": A,
                        "bytes_per_token_squared": B, "measured": measured,
                        "paper": paper_bytes(h, a, target, b, tp, sel),
                        "llama": llama_bytes(h, F, a, g, target, b, tp, sel),
                        "llama_flash": llama_bytes(h, F, a, g, target, b, tp, sel, flash=True),
                        "native_accounting": native_bytes(h, F, a, g, target, b, tp, sel),
                        # the Llama list with this engine's attention: native's SDPA keeps the log-sum-exp (flash),
                        # megatron-core's local spec the softmax
                        "llama_engine": llama_bytes(h, F, a, g, target, b, tp, sel, flash=job["engine"] == "native"),
                        "tensors": mine[0]["tensors"]})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="llama3-8b,llama3-70b")
    ap.add_argument("--tp", default="1,2,8")
    ap.add_argument("--seqs", default="256,512", help="two measured lengths (the s and s^2 terms are fitted)")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--recompute", default="none,selective")
    ap.add_argument("--target-seq", type=int, default=4096)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    recs = [None if r == "none" else r for r in a.recompute.split(",")]
    rows = table({w: WIDTHS[w] for w in a.widths.split(",")}, [int(t) for t in a.tp.split(",")], [int(s) for s in a.seqs.split(",")],
                 a.engines.split(","), recs, a.target_seq)
    gib = 2 ** 30
    print(f"saved activations per layer and rank, bf16, s={a.target_seq} b=1 (measured at s={a.seqs}, fitted A*s+B*s^2)")
    print(f"{'engine':14} {'width':11} {'TP':>3} {'recompute':9} {'measured':>10} {'paper':>10} {'ratio':>6} "
          f"{'Llama':>10} {'ratio':>6}  (Llama: the paper's list for Llama's layer, with native's flash-like or "
          "megatron-core's softmax attention)")
    for r in rows:
        print(f"{r['engine']:14} {r['width']:11} {r['tp']:>3} {r['recompute']:9} {r['measured'] / gib:>8.3f}Gi "
              f"{r['paper'] / gib:>8.3f}Gi {r['measured'] / r['paper']:>6.2f} {r['llama_engine'] / gib:>8.3f}Gi "
              f"{r['measured'] / r['llama_engine']:>6.2f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
