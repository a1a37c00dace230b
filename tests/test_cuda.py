"""The CUDA path (issue 21): skipped where torch sees no GPU (CI), run on the lent GPU machine by scripts/gpu_check.sh.

    FP8 GEMMs: torch._scaled_mm (forward, dgrad e5m2 x e4m3, wgrad) equals the fp32 emulation the CPU suite proves;
    attention: CUDA SDPA (flash / memory-efficient kernels) with packed-document masks equals attention run on each
        document alone, and flash-attn's varlen path equals it where flash-attn is installed;
    the trainer on the GPU: every parameter and optimizer state on the device, the same losses and grad norms as the
        same run on the CPU (fp32: 1e-4; bf16: 2e-2), a checkpoint saved from GPU memory resumes to the same run,
        dense and MoE (grouped experts, router) models.

A pipeline of several ranks needs one GPU per rank (NCCL refuses two ranks on one device): not run on one GPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# SHARDKIT_CUDA_REHEARSE=1 runs this file's code on the CPU (device "cpu"), to rehearse it before a GPU run
REHEARSE = os.environ.get("SHARDKIT_CUDA_REHEARSE") == "1"
DEV = "cpu" if REHEARSE else "cuda"
pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or REHEARSE), reason="no CUDA device")

REPO = Path(__file__).resolve().parent.parent
COMMON = ["--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
          "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--clip-grad", "1.0", "--seed", "7", "--log-interval", "1",
          "--attention-dropout", "0", "--hidden-dropout", "0", "--engine", "native"]  # the engine the CPU side runs
FLAGS = {"llama": [], "mixtral": ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"],
         "deepseek_v3": ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
                         "--moe-router-bias-update-rate", "0.01"]}


def _fp8_capable() -> bool:
    return REHEARSE or (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9))


# -- FP8 ----------------------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not _fp8_capable(), reason="no FP8 tensor cores (SM89+)")
def test_scaled_mm_equals_emulation_on_gpu():
    from train import fp8 as F8

    torch.manual_seed(3)
    a, b = torch.randn(256, 512, device=DEV), torch.randn(384, 512, device=DEV)
    sa, sb = F8.scale_from_amax(a.abs().max(), F8.E4M3), F8.scale_from_amax(b.abs().max(), F8.E4M3)
    qa, qb = F8.quantize(a, sa, F8.E4M3), F8.quantize(b, sb, F8.E4M3)
    assert F8._scaled_mm_ok(qa, qb) or REHEARSE  # the default path on this GPU is the kernel
    kernel = F8.fp8_mm(qa, 1 / sa, qb, 1 / sb, torch.float32, scaled_mm=True)
    emulated = F8.fp8_mm(qa, 1 / sa, qb, 1 / sb, torch.float32, scaled_mm=False)
    torch.testing.assert_close(kernel, emulated, rtol=1e-5, atol=1e-5 * emulated.abs().max().item())
    # the whole FP8 linear (forward e4m3 x e4m3, dgrad e5m2 x e4m3, wgrad) through the kernel equals the emulation
    x = torch.randn(128, 256, device=DEV, requires_grad=True)
    w = (torch.randn(192, 256, device=DEV) * 0.05).requires_grad_()
    g = torch.randn(128, 192, device=DEV) * 1e-3
    got = {}
    for recipe in ("tensorwise", "delayed"):
        for path in (False, True):
            x.grad = w.grad = None
            q = F8.Quantizer(recipe, F8.E4M3, F8.E5M2, True, scaled_mm=path)
            y = F8.fp8_linear(x, w, None, q)
            y.backward(g)
            got[path] = (y.detach(), x.grad.clone(), w.grad.clone())
        for emulated, kernel in zip(got[False], got[True], strict=True):
            torch.testing.assert_close(kernel, emulated, rtol=1e-5, atol=1e-6 * emulated.abs().max().item())
        exact = x.detach() @ w.detach().t()
        assert (got[True][0].float() - exact).norm() / exact.norm() < 0.1, recipe


# -- attention ------------------------------------------------------------------------------------------------------------

def _per_document(q, k, v, docs, hpg, scale):
    """Reference: causal attention of each document on its own (fp32), rows concatenated back."""
    out = torch.zeros_like(q, dtype=torch.float32)
    k, v = k.repeat_interleave(hpg, dim=1).float(), v.repeat_interleave(hpg, dim=1).float()
    for row in range(q.shape[0]):
        for d in docs[row].unique():
            idx = (docs[row] == d).nonzero().squeeze(1)
            out[row, :, idx] = torch.nn.functional.scaled_dot_product_attention(
                q[row:row + 1, :, idx].float(), k[row:row + 1, :, idx], v[row:row + 1, :, idx], is_causal=True,
                scale=scale)[0]
    return out


@pytest.mark.parametrize("backend", ["sdpa", "flash"])
def test_packed_attention_equals_per_document_on_gpu(backend):
    from train.parallel.context import prefix_attention

    if backend == "flash":
        pytest.importorskip("flash_attn")
    torch.manual_seed(0)
    b, H, G, s, d = 2, 8, 2, 512, 64
    q = torch.randn(b, H, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, G, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, G, s, d, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    cuts = [[0] * 100 + [1] * 300 + [2] * 112, [0] * 512]
    docs = torch.tensor(cuts, device=DEV)
    scale = d ** -0.5
    out = prefix_attention(q, k, v, H // G, scale, None, docs, docs, backend)
    ref = _per_document(q.detach(), k.detach(), v.detach(), docs, H // G, scale)
    err = (out.float() - ref).abs().max().item()
    assert err < 2e-2, err  # bf16 inputs and output: a few units in the last place
    # no documents: the causal kernel (flash on CUDA) equals an explicit dense causal mask
    plain = prefix_attention(q, k, v, H // G, scale, None, None, None, backend)
    mask = torch.ones(s, s, dtype=torch.bool, device=DEV).tril()
    dense = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(H // G, 1), v.float().repeat_interleave(H // G, 1), attn_mask=mask,
        scale=scale)
    assert (plain.float() - dense).abs().max().item() < 2e-2
    # gradients flow through the masked kernel to all three inputs and agree with the fp32 reference's
    out.float().square().sum().backward()
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    mask_docs = (docs[:, :, None] == docs[:, None, :]) & mask
    ref2 = torch.nn.functional.scaled_dot_product_attention(
        qr, kr.repeat_interleave(H // G, 1), vr.repeat_interleave(H // G, 1), attn_mask=mask_docs[:, None], scale=scale)
    ref2.square().sum().backward()
    for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
        rel = (got.float() - want).norm() / want.norm()
        assert rel < 2e-2, rel.item()


# -- the trainer on the GPU ------------------------------------------------------------------------------------------------

def _run(args: list[str], cpu: bool) -> str:
    env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="4")
    if cpu or REHEARSE:
        env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run([sys.executable, "-m", "shardkit", "continue-pretrain", *args], capture_output=True, text=True,
                       timeout=600, env=env, cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return r.stdout + r.stderr


def _rows(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from shardkit.cli import main as cli
    from shardkit.demo import build_tiny_llama
    from tests import moe_models
    from tests.corpus import write_pattern_corpus

    root = tmp_path_factory.mktemp("cuda")
    build_tiny_llama(root / "llama-hf", dtype=torch.float32)
    moe_models.build("mixtral", root / "mixtral-hf")
    moe_models.build("deepseek_v3", root / "deepseek_v3-hf")
    for kind in FLAGS:
        assert cli(["convert", "hf-to-mcore", str(root / f"{kind}-hf"), str(root / f"{kind}-ck"), "--quiet", "--no-verify"]) == 0
    write_pattern_corpus(root / "data")
    return root


@pytest.mark.parametrize("kind,precision", [("llama", "fp32"), ("llama", "bf16"), ("mixtral", "fp32"),
                                            ("deepseek_v3", "fp32")])
def test_trainer_on_gpu_equals_cpu(root, kind, precision):
    """The same 5 steps on the GPU and on the CPU: losses and grad norms agree (fp32 1e-4, bf16 2e-2 relative), the
    GPU run says it ran on cuda and reports its memory, its saved checkpoint (from GPU memory) is finite and complete,
    and the CPU reads it."""
    from checkpoint.reader import Checkpoint

    extra = (["--bf16"] if precision == "bf16" else []) + FLAGS[kind]
    runs = {}
    for dev in ("cuda", "cpu"):
        save = root / f"{kind}-{precision}-{dev}"
        log = _run(["--load", str(root / f"{kind}-ck"), "--data-path", str(root / "data"), "--save", str(save),
                    "--train-iters", "5", *COMMON, *extra], cpu=dev == "cpu")
        runs[dev] = _rows(save)
        if dev == "cuda" and not REHEARSE:
            assert torch.cuda.get_device_name() in log, log[-2000:]  # the start-up block names the device
    tol = 1e-4 if precision == "fp32" else 2e-2
    for g, c in zip(runs["cuda"], runs["cpu"], strict=True):
        assert abs(g["loss"] - c["loss"]) <= tol * abs(c["loss"]), (g["loss"], c["loss"])
        assert abs(g["grad_norm"] - c["grad_norm"]) <= 10 * tol * abs(c["grad_norm"]), (g["grad_norm"], c["grad_norm"])
    assert runs["cuda"][-1].get("mem_gib", 0) > 0  # peak GPU memory is measured on the device
    ck = Checkpoint(root / f"{kind}-{precision}-cuda" / "iter_0000005", check=True)
    sd = ck.state_dict(optimizer=True)
    assert any("exp_avg_sq" in n for n in sd) and any("fp32_param" in n for n in sd), "optimizer state saved"
    for name, t in sd.items():
        assert torch.isfinite(t.float()).all(), name


def test_checkpoint_saved_on_gpu_resumes_the_run(root):
    """Save at step 3 from GPU memory, resume on the GPU to step 6: the losses of steps 4-6 equal the straight run's
    (fp32; relative 1e-6: GPU reductions may differ in the last bits between launches)."""
    straight, part = root / "resume-straight", root / "resume-part"
    base = ["--load", str(root / "llama-ck"), "--data-path", str(root / "data"), *COMMON]
    _run([*base, "--save", str(straight), "--train-iters", "6"], cpu=False)
    _run([*base, "--save", str(part), "--train-iters", "6", "--exit-interval", "3"], cpu=False)
    _run(["--load", str(part), "--data-path", str(root / "data"), *COMMON, "--save", str(part), "--train-iters", "6"],
         cpu=False)
    want = [r["loss"] for r in _rows(straight)]
    got = [r["loss"] for r in _rows(part)]
    assert len(want) == 6 and len(got) == 6, (want, got)  # 3 rows from each launch
    for a, b in zip(got[-3:], want[-3:], strict=True):
        assert abs(a - b) <= 1e-6 * abs(b), (got, want)
    print("resume bitwise:", got[-3:] == want[-3:])
