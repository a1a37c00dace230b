"""Training metrics: model FLOPs under both MFU conventions, device peak FLOP/s, a JSONL/TensorBoard logger, plots.

MFU conventions (reference/training.md). Both count 6 FLOPs per GEMM weight per token (forward 2, backward 4) over
N = the weights of every matrix multiply a token goes through: attention and MLP projections, the router, the *active*
experts only (top-k routed plus shared), and the output layer; the input embedding is a lookup, not a GEMM, and norms
and biases are not GEMMs. They differ in the attention scores (QK^T and AV, 2 FLOPs per multiply-add, x3 for
forward+backward): Megatron-LM counts causal attention at half the full square, torchtitan counts the full square:

    megatron   = 6*N*T + 3 * L * s * nh * (d_qk + d_v) * T      (= 6*L*(nh*d)*s*T when d_qk = d_v = d)
    torchtitan = 6*N*T + 6 * L * s * nh * (d_qk + d_v) * T      (= 12*L*(nh*d)*s*T)

T = tokens in the step, s = sequence length, L = layers. MTP layers and sliding windows are not counted.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from checkpoint.config import ModelConfig
from checkpoint.errors import ShardkitError

# Dense (no sparsity) BF16 tensor-core peak per device, FLOP/s, from the vendors' data sheets. First match wins, so
# more specific names come first ("H100 PCIe" before "H100", "H200" before "H20", "L40S" before "L4").
PEAK_BF16: tuple[tuple[str, float], ...] = (
    ("GB200", 2.5e15), ("B200", 2.25e15), ("B100", 1.75e15),
    ("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("GH200", 989e12), ("H200", 989e12), ("H100", 989e12),
    ("H800", 989e12), ("H20", 148e12),
    ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12), ("L4", 121e12),
    ("MI325X", 1307e12), ("MI300X", 1307e12), ("MI250X", 383e12),
    ("V100", 125e12),  # fp16 tensor cores (no bf16)
)
_FP8_CAPABLE = ("GB200", "B200", "B100", "H100", "GH200", "H200", "H800", "H20", "L40S", "L4", "MI325X", "MI300X")


class MetricsError(ShardkitError):
    """A metrics file cannot be read or plotted; the message names it."""


# -- FLOPs -------------------------------------------------------------------------------------------------------------

def _attention_gemm_params(cfg: ModelConfig) -> int:
    h, nh = cfg.hidden_size, cfg.num_attention_heads
    if cfg.multi_latent_attention:
        q = (h * cfg.q_lora_rank + cfg.q_lora_rank * nh * cfg.q_head_dim if cfg.q_lora_rank
             else h * nh * cfg.q_head_dim)
        kv = h * (cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim) + \
            cfg.kv_lora_rank * nh * (cfg.qk_head_dim + cfg.v_head_dim)
        return q + kv + nh * cfg.v_head_dim * h
    return cfg.qkv_rows * h + nh * cfg.kv_channels * h


def _attention_head_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(d_qk, d_v): the dot-product width of QK^T and of AV per head."""
    if cfg.multi_latent_attention:
        return cfg.q_head_dim, cfg.v_head_dim
    return cfg.kv_channels, cfg.kv_channels


def _mlp_gemm_params(cfg: ModelConfig, layer: int) -> tuple[int, int]:
    """(active, total) GEMM weights of one layer's MLP (gated: fc1 is [gate; up])."""
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return 3 * h * cfg.ffn_hidden_size, 3 * h * cfg.ffn_hidden_size
    expert = 3 * h * cfg.moe_ffn_hidden_size
    shared = 3 * h * (cfg.moe_shared_expert_intermediate_size or 0)
    router = h * cfg.num_moe_experts
    return (router + cfg.moe_router_topk * expert + shared,
            router + cfg.num_moe_experts * expert + shared)


def _non_gemm_params(cfg: ModelConfig, layer: int) -> int:
    """Norm weights, biases and the router's expert bias of one layer (they exist but do no matrix multiply)."""
    h = cfg.hidden_size
    n = 2 * h  # input and pre-MLP norms
    if cfg.multi_latent_attention:
        n += cfg.kv_lora_rank + (cfg.q_lora_rank or 0)
    else:
        n += cfg.qkv_rows if cfg.add_qkv_bias else 0
        n += h if cfg.add_proj_bias else 0
    if cfg.is_moe_layer(layer):
        n += cfg.num_moe_experts if cfg.moe_router_enable_expert_bias else 0
    elif cfg.add_mlp_bias:
        n += 2 * cfg.ffn_hidden_size + h
    return n


def flops_per_step(cfg: ModelConfig, seq_length: int, tokens: int, vocab_size: int | None = None) -> dict[str, Any]:
    """Model FLOPs of one training step (forward + backward) of `tokens` tokens in sequences of `seq_length`.

    Returns both conventions (`megatron`, `torchtitan`, FLOPs per step and per token) and the parameter counts they
    rest on: `gemm_params_active` (N above), `params_total` (every weight incl. embeddings, norms and all experts,
    without MTP layers). `vocab_size` defaults to the true vocabulary (pass the padded one to count padding).
    """
    if seq_length < 1 or tokens < 0:
        raise ValueError(f"seq_length {seq_length} and tokens {tokens}: need seq_length >= 1, tokens >= 0")
    h, L = cfg.hidden_size, cfg.num_layers
    vocab = vocab_size or cfg.vocab_size
    attn = _attention_gemm_params(cfg)
    active = total = 0
    other = 0
    for layer in range(L):
        a, t = _mlp_gemm_params(cfg, layer)
        active += attn + a
        total += attn + t
        other += _non_gemm_params(cfg, layer)
    output = h * vocab
    active += output
    embedding = h * vocab
    params_total = total + other + h + embedding + (0 if cfg.tie_word_embeddings else output)
    d_qk, d_v = _attention_head_dims(cfg)
    attn_full = 6 * L * seq_length * cfg.num_attention_heads * (d_qk + d_v)  # per token, fwd+bwd, full square
    per_token_megatron = 6 * active + attn_full // 2
    per_token_torchtitan = 6 * active + attn_full
    return {
        "tokens": tokens, "seq_length": seq_length,
        "gemm_params_active": active, "gemm_params_total": total + output, "params_total": params_total,
        "flops_per_token_megatron": per_token_megatron, "flops_per_token_torchtitan": per_token_torchtitan,
        "megatron": per_token_megatron * tokens, "torchtitan": per_token_torchtitan * tokens,
    }


def peak_flops(device: Any = None, dtype: str = "bf16") -> float | None:
    """Dense tensor-core peak FLOP/s of a CUDA/ROCm device (bf16, or fp8 = 2x where supported); None when unknown
    (CPU, an unlisted GPU): the caller then takes --peak-tflops or reports no MFU."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return None
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type != "cuda":
        return None
    if not torch.cuda.is_available():
        return None
    return peak_flops_for_name(torch.cuda.get_device_name(dev), dtype)


def peak_flops_for_name(name: str, dtype: str = "bf16") -> float | None:
    """Peak FLOP/s for a device name as torch.cuda.get_device_name() reports it (e.g. 'NVIDIA H100 80GB HBM3')."""
    for key, peak in PEAK_BF16:
        if key.lower() in name.lower():
            if dtype in ("bf16", "fp16"):
                return peak
            if dtype == "fp8":
                return 2 * peak if key in _FP8_CAPABLE else None
            return None
    return None


def throughput(flops: dict, step_seconds: float, world_size: int, peak: float | None) -> dict[str, float | None]:
    """tokens/s (total and per device), model TFLOP/s per device and MFU under both conventions for one step."""
    out: dict[str, float | None] = {
        "tokens_per_s": flops["tokens"] / step_seconds,
        "tokens_per_s_per_device": flops["tokens"] / step_seconds / world_size,
    }
    for conv in ("megatron", "torchtitan"):
        per_device = flops[conv] / step_seconds / world_size
        out[f"tflops_per_device_{conv}"] = per_device / 1e12
        out[f"mfu_{conv}"] = per_device / peak if peak else None
    return out


def memory_stats(device: Any = None) -> dict[str, float]:
    """Peak memory in GiB: CUDA allocated/reserved on a GPU, else the process's peak resident set."""
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        return {"mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30,
                "mem_reserved_gib": torch.cuda.max_memory_reserved(dev) / 2**30}
    import resource

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"mem_gib": rss / (2**30 if sys.platform == "darwin" else 2**20)}


# -- logging -----------------------------------------------------------------------------------------------------------

class MetricsLogger:
    """One JSON object per logged iteration appended to `<run_dir>/metrics.jsonl` (flushed each time, so a crash
    loses nothing logged), TensorBoard scalars when `torch.utils.tensorboard` imports (continue-pretrain refuses
    --tensorboard-dir at start-up where it does not: `tensorboard_missing`), and a human log line.

    Only `rank == writer_rank` writes; other ranks' calls are no-ops (so every rank can call it). Known keys, all
    optional: loss, valid_loss, lr, grad_norm, tokens_per_s, mfu_megatron, mfu_torchtitan, mem_gib, step_seconds,
    consumed_samples; any other numeric key is stored and sent to TensorBoard too.

    `wandb` (Megatron-LM's --wandb-project / --wandb-exp-name / --wandb-save-dir as {"project", "name", "dir",
    "config"}): the same scalars go to Weights & Biases too, wandb imported only then; offline mode when its server
    cannot be reached (or WANDB_MODE says so). `run_dir` None: no metrics.jsonl or TensorBoard (W&B only).
    """

    def __init__(self, run_dir: str | os.PathLike | None, rank: int, writer_rank: int = 0, tensorboard: bool = True,
                 wandb: dict | None = None):
        self.enabled = rank == writer_rank
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.path = self.run_dir / "metrics.jsonl" if self.run_dir is not None else None
        self._file = None
        self._tb = None
        self._wandb = None
        if wandb and wandb.get("project"):
            self._wandb = _wandb_run(wandb, self.enabled)  # every rank: a missing wandb stops all of them
        if not self.enabled or self.run_dir is None:
            return
        from checkpoint.safety import check_target

        check_target(self.path, "metrics", ours=True)  # appended to: a link or a FIFO there is refused, never followed
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        except OSError as e:
            raise MetricsError(f"{self.path}: cannot write metrics ({e.strerror})") from None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSONL only
                SummaryWriter = None
            if SummaryWriter is not None:
                self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    @property
    def tensorboard(self) -> bool:
        return self._tb is not None

    def log(self, iteration: int, metrics: dict[str, Any], train_iters: int | None = None,
            echo: bool = True) -> str | None:
        """Record one iteration; returns (and prints to stdout when `echo`) the human line."""
        if not self.enabled:
            return None
        rec = {"iteration": int(iteration), "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        if self._file is not None:
            self._file.write(json.dumps(rec) + "\n")
            self._file.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in rec.items() if k not in ("iteration", "time")
                             and isinstance(v, (int, float)) and not isinstance(v, bool)}, step=int(iteration))
        if self._tb is not None:
            for k, v in rec.items():
                if k not in ("iteration", "time") and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, int(iteration))
            self._tb.flush()
        line = format_line(int(iteration), rec, train_iters)
        if echo:
            print(line, flush=True)
        return line

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tensorboard_missing() -> str | None:
    """Why TensorBoard events cannot be written here (None: they can): --tensorboard-dir is refused at start-up
    then, instead of the run writing metrics.jsonl alone. Imports torch.utils.tensorboard (as MetricsLogger will)."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as e:
        return str(e) or type(e).__name__
    return None


WANDB_HOST = ("api.wandb.ai", 443)


def _online(timeout: float = 2.0) -> bool:
    """Can this host reach the W&B server? (A compute node without a network gets offline mode: `wandb sync`
    uploads the run later.)"""
    import socket

    try:
        with socket.create_connection(WANDB_HOST, timeout=timeout):
            return True
    except OSError:
        return False


def check_wandb(project: str) -> None:
    """--wandb-project needs wandb installed (found without importing it: its import is slow)."""
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        raise MetricsError(f"--wandb-project {project}: wandb is not installed (pip install wandb, or drop the flag)")


def _wandb_run(cfg: dict, writer: bool):
    """wandb.init on the writer rank (None elsewhere); a missing wandb is one line on every rank."""
    check_wandb(cfg["project"])
    if not writer:
        return None
    try:
        import wandb
    except ImportError as e:
        raise MetricsError(f"--wandb-project {cfg['project']}: wandb cannot be imported ({e})") from None
    save_dir = Path(cfg["dir"])
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MetricsError(f"--wandb-save-dir {save_dir}: cannot create ({e.strerror})") from None
    mode = os.environ.get("WANDB_MODE") or ("online" if _online() else "offline")
    try:
        return wandb.init(project=cfg["project"], name=cfg.get("name") or None, dir=str(save_dir),
                          config=cfg.get("config") or {}, mode=mode)
    except Exception as e:  # wandb's own errors (bad credentials, a refused project): one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise MetricsError(f"--wandb-project {cfg['project']}: wandb.init failed ({first})") from None


def _plain(v: Any) -> Any:
    """Tensors and numpy scalars as Python numbers; NaN/inf kept as floats (json writes NaN/Infinity)."""
    if hasattr(v, "item") and callable(v.item):
        try:
            return v.item()
        except (ValueError, RuntimeError):
            pass
    return v


def format_line(iteration: int, m: dict[str, Any], train_iters: int | None = None) -> str:
    """Megatron-style one-line summary of an iteration; fields that are missing or None are left out."""
    parts = [f"iteration {iteration}" + (f"/{train_iters}" if train_iters else "")]

    def add(key: str, fmt) -> None:
        v = m.get(key)
        if v is not None:
            parts.append(fmt(v))

    add("consumed_samples", lambda v: f"consumed samples {v}")
    add("step_seconds", lambda v: f"{v * 1e3:.1f} ms/iter")
    add("lr", lambda v: f"lr {v:.3e}")  # the LR this iteration's step applied (Megatron-LM prints the next one)
    add("weight_decay", lambda v: f"wd {v:.3g}")
    add("loss", lambda v: f"loss {v:.6f}")
    add("valid_loss", lambda v: f"valid loss {v:.6f}")
    add("grad_norm", lambda v: f"grad norm {v:.4f}")
    # MoE (train/moe.py): Megatron's names, the load-balancing loss without its coefficient
    add("load_balancing_loss", lambda v: f"load_balancing_loss {v:.4f}")
    add("seq_load_balancing_loss", lambda v: f"seq_load_balancing_loss {v:.4f}")
    add("mtp_loss", lambda v: f"mtp loss {v:.4f}")
    add("moe_max_load_imbalance", lambda v: f"max expert load / mean {v:.2f}")
    add("tokens_per_s" if "tokens_per_s" in m else "tokens_per_second", lambda v: f"{v:,.0f} tokens/s")
    if m.get("mfu_megatron") is not None or m.get("mfu_torchtitan") is not None:
        pct = lambda v: "n/a" if v is None else f"{100 * v:.1f}%"  # noqa: E731
        parts.append(f"MFU {pct(m.get('mfu_megatron'))} megatron / {pct(m.get('mfu_torchtitan'))} torchtitan")
    add("mem_gib", lambda v: f"mem {v:.2f} GiB")
    return " | ".join(parts)


# -- reading and plotting ----------------------------------------------------------------------------------------------

def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Records of a metrics.jsonl (or of the one in a run directory), one per iteration in iteration order; when a
    resumed run logged an iteration again, its latest record wins."""
    from checkpoint.safety import regular_file

    p = Path(path)
    if p.is_dir():
        p = p / "metrics.jsonl"
    if not regular_file(p, missing_ok=True):  # a FIFO or a device: one line naming it, never a hang
        raise MetricsError(f"{p}: no such metrics file (a training run writes metrics.jsonl in its --save directory)")
    with open(p, encoding="utf-8") as f:
        lines = f.read().splitlines()
    latest: dict[int, dict] = {}
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):
                continue  # a last line cut short by a crash
            raise MetricsError(f"{p} line {lineno}: not valid JSON") from None
        if not isinstance(rec, dict) or not isinstance(rec.get("iteration"), int):
            raise MetricsError(f"{p} line {lineno}: expected an object with an integer 'iteration'")
        latest[rec["iteration"]] = rec
    if not latest:
        raise MetricsError(f"{p}: no records")
    return [latest[i] for i in sorted(latest)]


def plot_metrics(path: str | os.PathLike, output: str | os.PathLike | None = None) -> Path:
    """PNG of loss (train, and valid when logged) and learning rate against iteration; written atomically."""
    recs = read_metrics(path)
    src = Path(path)
    out = Path(output) if output else (src if src.is_dir() else src.parent) / "metrics.png"

    def series(key: str) -> tuple[list[int], list[float]]:
        pts = [(r["iteration"], r[key]) for r in recs if isinstance(r.get(key), (int, float))
               and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
        return [p[0] for p in pts], [p[1] for p in pts]

    loss, lr, valid = series("loss"), series("lr"), series("valid_loss")
    if not loss[0] and not lr[0]:
        raise MetricsError(f"{src}: no 'loss' or 'lr' values to plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    try:
        ax_loss.plot(*loss, label="train loss", lw=1.2)
        if valid[0]:
            ax_loss.plot(*valid, "o-", label="valid loss", lw=1.2, ms=3)
        ax_loss.set_ylabel("loss")
        ax_loss.grid(alpha=0.3)
        ax_loss.legend()
        ax_loss.set_title(f"{src.resolve().name if src.is_dir() else src.resolve().parent.name}: "
                          f"{len(recs)} logged iterations")
        ax_lr.plot(*lr, color="tab:orange", lw=1.2)
        ax_lr.set_ylabel("learning rate")
        ax_lr.set_xlabel("iteration")
        ax_lr.grid(alpha=0.3)
        ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
        from matplotlib.ticker import MaxNLocator

        ax_lr.xaxis.set_major_locator(MaxNLocator(integer=True))  # iterations are whole: no tick at 2.5
        fig.tight_layout()
        tmp = out.with_name(f".{out.name}.tmp")
        blocker = next((p for p in (out.parent, *out.parent.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise MetricsError(f"{out}: cannot write: {blocker} is not a directory")
        from checkpoint.safety import check_target

        check_target(out, "--output", ours=True)  # a link or a non-regular file there: never written through
        check_target(tmp, "--output", ours=True)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(tmp, format="png", dpi=120)
            os.replace(tmp, out)
        except OSError as e:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise MetricsError(f"{out}: cannot write ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out


def plot_main(args) -> int:
    """`shardkit plot RUN_DIR [--output FILE.png]`."""
    out = plot_metrics(args.run_dir, args.output)
    print(f"wrote {out}")
    return 0
