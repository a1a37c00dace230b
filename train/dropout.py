"""Dropout as megatron-core applies it (Megatron-LM's --attention-dropout / --hidden-dropout, default 0.1 each), with
the random streams of megatron-core's CUDA RNG tracker (tensor_parallel/random.py `model_parallel_cuda_manual_seed`):

    default stream   seed + 100 * pp_rank (Megatron-LM's _set_random_seed; the same on every TP, CP and DP rank)
    TP stream        that + 2718 + tp_rank (the tracker's "model-parallel-rng", entered with `fork()`)

and where megatron-core draws from which (0.16):

    embedding dropout (hidden_dropout)   TP stream under sequence parallelism (the embedding output is the rank's
                                         sequence slice), else the default stream (replicated activations: the same
                                         mask on every TP rank)
    attention-probability dropout        TP stream without sequence parallelism (heads are split over TP ranks);
                                         with it megatron-core's DotProductAttention draws from the default stream
    bias-dropout-add after attention     the default stream (TransformerLayer runs it outside any fork)
    and after the MLP

Each stream is a torch.Generator of the rank's device; masks are drawn with it, never with the global RNG, so the
data order, the router and everything else are unaffected by dropout. Recomputed forwards (full or selective
recompute) draw the same masks: `recompute_context` (torch.utils.checkpoint's context_fn) saves the streams at the
original forward and replays them for the recompute, as megatron-core's CheckpointFunction saves the tracker states.

One difference from Megatron-LM, which runs each stream on from its seed and saves every rank's tracker state in
its checkpoints: here both streams restart at each iteration from (their seed, the iteration) (`iteration_of`, set
by the trainer), so a resumed run draws exactly the masks the uninterrupted run drew, with nothing in the
checkpoint (shardkit's train_state holds one rank's RNG state). Masks are drawn only in training forwards (grad
enabled: evaluation runs under no_grad, where Megatron's model.eval() turns dropout off)."""
from __future__ import annotations

import contextlib

import torch
from torch import Tensor

TP_SEED_OFFSET = 2718  # megatron-core model_parallel_cuda_manual_seed
PP_SEED_STRIDE = 100  # Megatron-LM _set_random_seed
_MIX = 1_000_003


def seed_process_rngs(seed: int, pp_rank: int) -> int:
    """Megatron-LM's _set_random_seed for the process-wide generators: Python's, numpy's and torch's seeded with
    seed + 100 * pp_rank at the start of a run (a resume then restores the saved states over them), so what draws
    from them and the RNG state a save records are the same in every run of the same command. Returns that seed
    (Megatron-LM seeds megatron-core's CUDA RNG tracker with it too)."""
    import random

    import numpy as np

    s = seed + PP_SEED_STRIDE * pp_rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)
    return s


class DropoutRNG:
    def __init__(self, seed: int, pp_rank: int, tp_rank: int, sp: bool, device: torch.device) -> None:
        self.seeds = (seed + PP_SEED_STRIDE * pp_rank, seed + PP_SEED_STRIDE * pp_rank + TP_SEED_OFFSET + tp_rank)
        self.default = torch.Generator(device=device).manual_seed(self.seeds[0])
        self.tp = torch.Generator(device=device).manual_seed(self.seeds[1])
        self.sp = sp
        self.iteration_of = None  # the trainer's current iteration (a callable); None: the streams just run on
        self._at = None

    def _sync(self) -> None:
        if self.iteration_of is None:
            return
        it = self.iteration_of()
        if it != self._at:
            self._at = it
            for gen, seed in zip((self.default, self.tp), self.seeds):
                gen.manual_seed((seed * _MIX + it) % (1 << 63))

    # which stream each site draws from (module docstring)
    def embedding(self) -> torch.Generator:
        self._sync()
        return self.tp if self.sp else self.default

    def attention(self) -> torch.Generator:
        self._sync()
        return self.default if self.sp else self.tp

    def residual(self) -> torch.Generator:
        self._sync()
        return self.default

    def get_states(self) -> tuple[Tensor, Tensor]:
        return self.default.get_state(), self.tp.get_state()

    def set_states(self, states: tuple[Tensor, Tensor]) -> None:
        self.default.set_state(states[0])
        self.tp.set_state(states[1])

    def recompute_context(self):
        """torch.utils.checkpoint context_fn: the forward notes the streams' states; the recompute runs from them and
        leaves the streams where they were before it."""
        saved: list = []

        @contextlib.contextmanager
        def forward():
            self._sync()
            saved.append(self.get_states())
            yield

        @contextlib.contextmanager
        def recompute():
            now = self.get_states()
            self.set_states(saved[0])
            try:
                yield
            finally:
                self.set_states(now)

        return forward(), recompute()


def dropout(x: Tensor, p: float, gen: torch.Generator | None, training: bool = True) -> Tensor:
    """Inverted dropout of x with probability p, the keep mask drawn from `gen` (Bernoulli(1 - p) per element)."""
    if not p or not training or gen is None or not torch.is_grad_enabled():
        return x
    keep = torch.empty(x.shape, dtype=torch.float32, device=x.device).uniform_(generator=gen) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


def attention_with_dropout(q: Tensor, k: Tensor, v: Tensor, p: float, gen: torch.Generator,
                           mask: Tensor | None = None, scale: float | None = None) -> Tensor:
    """softmax(q k^T * scale) with causal (or `mask`: True = attend) masking, dropout p on the probabilities, times v
    (megatron-core's unfused DotProductAttention: the dropped probabilities multiply v). q [b, H, s, d]; k [b, G, s, d]
    and v [b, G, s, dv] with H = G * hpg, group-major (KV head g serves query heads g*hpg .. (g+1)*hpg - 1)."""
    hpg = q.shape[1] // k.shape[1]
    if hpg > 1:
        k, v = k.repeat_interleave(hpg, dim=1), v.repeat_interleave(hpg, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    s, sk = q.shape[2], k.shape[2]
    allowed = (torch.ones(s, sk, dtype=torch.bool, device=q.device).tril(sk - s) if mask is None
               else mask.to(torch.bool))
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = dropout(scores.softmax(dim=-1), p, gen)
    return torch.matmul(probs.to(v.dtype), v)
