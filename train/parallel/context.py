"""Context parallelism (CP) and packed-document attention, hooked onto the plain model from outside.

Zigzag split (Megatron / Transformer Engine `get_batch_on_this_cp_rank`): a sequence of S tokens is cut into 2*cp
chunks of c = S/(2cp) tokens; CP rank r holds chunks r and 2cp-1-r, so with causal attention every rank has the same
amount of work. Tokens, labels, loss weights and RoPE position ids are split together: a rank's RoPE uses the global
positions of its chunks. Every CP rank reads the same micro-batches (the data loader sees the DP rank only), so each
one knows the whole sequence's document ids and no mask ever travels.

Attention over the split sequence, two ways (`--cp-comm-type`):

- p2p (ring attention): K/V blocks go round the CP ring with isend/irecv while the local queries attend to the block in
  hand; partial results are merged with their log-sum-exp. A torch.autograd.Function with an explicit backward ring:
  K/V go round again and each block's dK/dV accumulator travels with it, arriving home after cp steps. Per chunk pair
  (query chunk i, key chunk j, global chunk indices): i == j is causal (the diagonal block), i > j is full, i < j is
  skipped, which makes each ring step one block (`ring_block`); document and sliding-window masks are built from
  global token indices.
- all_gather: K/V are all-gathered over CP (an autograd all-gather whose backward is a reduce-scatter) and each local
  query chunk attends to the key prefix that ends with it (causal aligned bottom-right), through flash-attn or SDPA.

Only the query groups' own K/V travel: the model hands attention one K/V head per query group, and each group
serves its query heads (SDPA's GQA, `train.model.gqa_attention`, or the ring's grouped blocks).

Packed documents follow Megatron's `get_ltor_masks_and_position_ids`: with --reset-position-ids positions restart after
each EOD token, with --reset-attention-mask a token attends only within its document, with --eod-mask-loss the loss
skips positions whose input token is EOD. A block whose rows are all masked gives log-sum-exp -inf and contributes
nothing (never NaN); the loss divides by the micro-batch's token count over the whole sequence, so a CP rank whose
tokens are all masked gives 0, not 0/0 (Megatron-LM #1764).

Attention backend: flash-attn (`flash_attn_func`; `flash_attn_varlen_func` with cu_seqlens for packed documents) when it
is installed, the model runs on CUDA in bf16/fp16 and the head dims of q and v agree; torch SDPA otherwise. The ring's
blocks use a plain-torch kernel (fp32 scores, explicit log-sum-exp) so that it runs on CPU and GPU alike.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from checkpoint.errors import ConfigError, ShardkitError
from train.model import gqa_attention

from . import comm, p2p

COMM_TYPES = ("p2p", "all_gather")


# -- layout math (pure) ------------------------------------------------------------------------------------------------

def check_sequence(seq_length: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """--seq-length must split into 2*cp zigzag chunks (and, with sequence parallelism, a rank's share into tp)."""
    if cp < 1:
        raise ConfigError(f"--context-parallel-size must be >= 1, got {cp}")
    if cp > 1 and seq_length % (2 * cp):
        raise ConfigError(f"--context-parallel-size {cp}: --seq-length {seq_length} is not divisible by 2 x cp = "
                          f"{2 * cp} (zigzag chunks); pick a sequence length that is a multiple of {2 * cp}")
    if sequence_parallel and tp > 1 and (seq_length // cp) % tp:
        raise ConfigError(f"--sequence-parallel: --seq-length {seq_length} / --cp {cp} = {seq_length // cp} tokens "
                          f"per CP rank is not divisible by --tp {tp}")


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices CP rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_index(seq_length: int, cp: int, rank: int, device: torch.device | None = None) -> Tensor:
    """Global token indices held by CP rank `rank`, in local order: [chunk r; chunk 2cp-1-r]."""
    if cp == 1:
        return torch.arange(seq_length, device=device)
    c = seq_length // (2 * cp)
    a, b = zigzag_chunks(cp, rank)
    return torch.cat([torch.arange(a * c, (a + 1) * c, device=device), torch.arange(b * c, (b + 1) * c, device=device)])


def zigzag_split(x: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This CP rank's part of x along `dim` (the sequence)."""
    if cp == 1:
        return x
    return x.index_select(dim, zigzag_index(x.shape[dim], cp, rank, x.device))


def zigzag_order(cp: int) -> list[int]:
    """Position of each global chunk in the rank-ordered concatenation of all ranks' local sequences
    ([r0: c0, c_{2cp-1}; r1: c1, c_{2cp-2}; ...]): global chunk i sits at slot order[i]."""
    order = [0] * (2 * cp)
    for r in range(cp):
        a, b = zigzag_chunks(cp, r)
        order[a], order[b] = 2 * r, 2 * r + 1
    return order


@dataclass(frozen=True)
class Packing:
    """Megatron's packed-document flags; `eod` is the end-of-document token id."""

    eod: int | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False

    @property
    def active(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask or self.eod_mask_loss


def packing_from(data, model_cfg, hf_dir=None) -> Packing:
    """Packing flags of DataArgs; the EOD id is --eod-token-id, else the checkpoint's tokenizer's eos_token_id (what
    `preprocess-data --append-eod` appends), else the HF config's eos_token_id (the first one of a list)."""
    flags = {"reset_position_ids": bool(data.reset_position_ids),
             "reset_attention_mask": bool(data.reset_attention_mask), "eod_mask_loss": bool(data.eod_mask_loss)}
    if not any(flags.values()):
        return Packing(None, **flags)
    eod = data.eod_token_id
    if eod is None and hf_dir is not None and any(Path(hf_dir).glob("tokenizer*")):
        try:
            from train.data.preprocess import load_tokenizer

            eod = load_tokenizer(hf_dir).eos_token_id
        except (ShardkitError, OSError, ValueError, ImportError):  # unreadable tokenizer: fall back to the config
            eod = None
    if eod is None:
        eos = model_cfg.hf_config.get("eos_token_id")
        eod = eos[0] if isinstance(eos, list) and eos else eos
    if eod is None:
        raise ConfigError("--reset-position-ids / --reset-attention-mask / --eod-mask-loss need the end-of-document "
                          "token, and the checkpoint has no tokenizer or eos_token_id; pass --eod-token-id")
    return Packing(int(eod), **flags)


def ltor_masks_and_position_ids(tokens: Tensor, packing: Packing) -> tuple[Tensor, Tensor, Tensor | None]:
    """Megatron's `get_ltor_masks_and_position_ids` without the dense [s, s] mask: (position_ids [b, s], loss_mask
    [b, s] fp32, document ids [b, s] or None). Token t belongs to document (number of EODs before t), so an EOD ends
    its document; attention is causal within a document (None: causal over the whole sequence)."""
    b, s = tokens.shape
    idx = torch.arange(s, device=tokens.device).expand(b, s)
    loss_mask = torch.ones(b, s, dtype=torch.float32, device=tokens.device)
    if not packing.active:
        return idx, loss_mask, None
    eod = tokens == packing.eod
    if packing.eod_mask_loss:
        loss_mask = loss_mask.masked_fill(eod, 0.0)
    docs = torch.cumsum(eod.long(), dim=1) - eod.long()
    positions = idx
    if packing.reset_position_ids:
        starts = torch.zeros_like(eod)
        starts[:, 1:] = eod[:, :-1]
        starts[:, 0] = True
        first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
        positions = idx - first
    return positions, loss_mask, docs if packing.reset_attention_mask else None


@dataclass(frozen=True)
class AttentionLayout:
    """What attention needs to know about one micro-batch: its global length, the CP split, and (packed documents
    with --reset-attention-mask) the document id of every token of the whole sequence [b, S]. Whatever the host must
    know about the documents is known from the host's copy (`docs_host`): which ring blocks they mask entirely
    (`masked`), and the cu_seqlens of flash-attn's / TE's varlen calls (`varlen`, built once per micro-batch and
    query chunk, not once per layer), so no layer reads the device (issue 32's host-sync budget)."""

    seq_length: int
    cp: int = 1
    cp_rank: int = 0
    docs: Tensor | None = None
    docs_host: Tensor | None = None  # the same ids on the CPU (None: read from `docs` where needed)
    masked: frozenset | None = None  # ring sources whose block the documents mask entirely (None: not known)
    packs: dict = field(default_factory=dict, compare=False, repr=False)  # varlen packs of this micro-batch

    @property
    def chunk(self) -> int:
        return self.seq_length // (2 * self.cp)

    def chunk_docs(self, i: int) -> Tensor | None:
        """Document ids of global chunk i, [b, c]."""
        if self.docs is None:
            return None
        c = self.chunk
        return self.docs[:, i * c:(i + 1) * c]

    def varlen(self, q_chunk: int | None = None, k_end: int | None = None) -> "VarlenPack":
        """The varlen segments of queries = global chunk `q_chunk` (None: the whole sequence) against the keys up to
        `k_end` (None: the whole sequence), from the host's ids, on the device of `docs`; cached per micro-batch."""
        key = (q_chunk, k_end)
        if key not in self.packs:
            docs = self.docs_host if self.docs_host is not None else self.docs
            c = self.chunk
            dq = docs if q_chunk is None else docs[:, q_chunk * c:(q_chunk + 1) * c]
            pack = varlen_pack(dq, docs if k_end is None else docs[:, :k_end])
            dev = self.docs.device
            self.packs[key] = VarlenPack(pack.cu_q.to(dev), pack.cu_k.to(dev), pack.max_q, pack.max_k,
                                         pack.k_index.to(dev))
        return self.packs[key]


def masked_ring_sources(docs: Tensor, seq_length: int, cp: int, rank: int) -> frozenset:
    """The CP ranks whose K/V block the documents mask entirely for `rank`'s queries (ring_block's blocks), from
    document ids on the host."""
    out = set()
    for src in range(cp):
        q_rows, k_rows = _ring_rows(seq_length, cp, rank, src)
        q_pos = zigzag_index(seq_length, cp, rank)[q_rows]
        k_pos = zigzag_index(seq_length, cp, src)[k_rows]
        mask = block_mask(q_pos, k_pos, docs[:, q_pos], docs[:, k_pos], None, causal=src == rank)
        if mask is not None and not bool(mask.any()):
            out.add(src)
    return frozenset(out)


@dataclass(frozen=True)
class MicroBatchExtras:
    """A micro-batch's per-token extras on this CP rank: global RoPE positions, loss weights (loss mask times
    cp / tokens counted in the whole micro-batch, so that summing over CP ranks and averaging over DP x CP gives the
    micro-batch's mean loss) and the attention layout. `whole`: (input ids, labels, loss mask) [b, S] of the whole
    micro-batch before the split (every CP rank reads all of it): the MTP loss shifts them by whole sequences
    (train.moe.mtp_targets), so a token beyond a chunk boundary needs no exchange between CP ranks."""

    position_ids: Tensor
    loss_weight: Tensor
    layout: AttentionLayout
    whole: tuple[Tensor, Tensor, Tensor] | None = None


def prepare_micro_batch(sample: Tensor, cp: int, cp_rank: int, packing: Packing, device: torch.device | None = None
                        ) -> tuple[Tensor, Tensor, MicroBatchExtras]:
    """[b, S+1] tokens -> (input ids, labels, extras), each split for this CP rank (zigzag). Computed where `sample`
    is (the host, in the trainer) and moved to `device` (default: stay): what the host must know about the documents
    is read from its own copy, never from the device."""
    tokens, labels = sample[:, :-1], sample[:, 1:]
    positions, loss_mask, docs = ltor_masks_and_position_ids(tokens, packing)
    counted = loss_mask.sum().clamp_min(1.0)  # an all-masked micro-batch gives loss 0, not NaN
    weight = loss_mask * (cp / counted)
    S = tokens.shape[1]
    dev = sample.device if device is None else torch.device(device)

    def on(t: Tensor) -> Tensor:  # host to device (never a read of the device); nothing to do where it already is
        return t if t.device == dev else t.to(dev)

    def split(t: Tensor) -> Tensor:
        return on(zigzag_split(t, cp, cp_rank).contiguous())

    host = docs is not None and docs.device.type == "cpu"
    masked = masked_ring_sources(docs, S, cp, cp_rank) if host and cp > 1 else None
    layout = AttentionLayout(S, cp, cp_rank, None if docs is None else on(docs), docs if host else None, masked)
    return split(tokens), split(labels), MicroBatchExtras(split(positions), split(weight), layout,
                                                          (on(tokens), on(labels), on(loss_mask)))


# -- masks and the plain-torch block kernel ----------------------------------------------------------------------------

def block_mask(q_pos: Tensor, k_pos: Tensor, docs_q: Tensor | None, docs_k: Tensor | None, window: int | None,
               causal: bool = True) -> Tensor | None:
    """Boolean mask [b|1, 1, sq, sk] (True: attend) for queries at global positions q_pos against keys at k_pos;
    None when every pair attends."""
    mask = None
    if causal:
        mask = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if window is not None:
        w = (q_pos[:, None] - k_pos[None, :] < window)[None, None]
        mask = w if mask is None else mask & w
    if docs_q is not None:
        d = (docs_q[:, :, None] == docs_k[:, None, :])[:, None]
        mask = d if mask is None else mask & d
    return mask


def _block_forward(q5: Tensor, k5: Tensor, v5: Tensor, mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor]:
    """q5 [b, G, hpg, sq, d], k5/v5 [b, G, 1, sk, d*] (fp32), mask [b|1, 1, sq, sk] -> (out, lse [b, G, hpg, sq]).
    Rows with no key give lse -inf and out 0."""
    s = torch.matmul(q5, k5.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    return torch.matmul(p, v5), lse


def _block_backward(q5: Tensor, k5: Tensor, v5: Tensor, mask: Tensor | None, scale: float, lse: Tensor, do5: Tensor,
                    delta: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the merged output's lse, dO and delta = rowsum(dO * O): (dq5, dk [b, G, sk, d],
    dv [b, G, sk, dv]) (FlashAttention's backward, in plain torch)."""
    s = torch.matmul(q5, k5.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(1), float("-inf"))
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), do5).sum(dim=2)
    dp = torch.matmul(do5, v5.transpose(-1, -2))
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k5) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q5).sum(dim=2) * scale
    return dq, dk, dv


def _finite(lse: Tensor) -> Tensor:
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


def _merge(out: Tensor, lse: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Combine two partial softmax results over disjoint key sets by their log-sum-exp (-inf: no keys)."""
    new = torch.logaddexp(lse, lse_b)
    safe = _finite(new)
    return (out * torch.exp(lse - safe).unsqueeze(-1) + out_b * torch.exp(lse_b - safe).unsqueeze(-1)), new


def _ring_rows(seq_length: int, cp: int, rank: int, src: int) -> tuple[slice, slice]:
    c = seq_length // (2 * cp)
    both, first, second = slice(0, 2 * c), slice(0, c), slice(c, 2 * c)
    return (both, both) if src == rank else (both, first) if src < rank else (second, both)


def ring_block(layout: AttentionLayout, rank: int, src: int, window: int | None, device: torch.device
               ) -> tuple[slice, slice, Tensor | None] | None:
    """What this rank's queries (chunks r, 2cp-1-r) compute against the K/V of rank `src` (chunks s, 2cp-1-s), as
    one block: (query rows, key rows, mask) or None when nothing attends. Chunk pairs: the diagonal is causal, an
    earlier key chunk is full, a later one is skipped, which leaves
        src == rank  all queries x all keys, causal (the local order is the global order)
        src <  rank  all queries x the first key chunk, full
        src >  rank  the second query chunk x all keys, full
    so every step but the first does the same work on every rank (zigzag's load balance). Documents and the sliding
    window are applied from global positions; a block they mask entirely is skipped, decided on the host (the
    window from the chunks' positions, the documents from `layout.masked`; a layout without it reads the mask)."""
    q_rows, k_rows = _ring_rows(layout.seq_length, layout.cp, rank, src)
    c = layout.chunk
    if window is not None and src != rank:  # the nearest pair of the block, from the chunk indices alone
        qa, qb = zigzag_chunks(layout.cp, rank)
        ka, kb = zigzag_chunks(layout.cp, src)
        q_first = (qa if q_rows.start == 0 else qb) * c
        k_last = (kb if k_rows.stop == 2 * c else ka) * c + c - 1
        if q_first - k_last >= window:
            return None
    if layout.masked is not None and src in layout.masked:
        return None
    q_pos = zigzag_index(layout.seq_length, layout.cp, rank, device)[q_rows]
    k_pos = zigzag_index(layout.seq_length, layout.cp, src, device)[k_rows]
    docs = layout.docs
    mask = block_mask(q_pos, k_pos, None if docs is None else docs[:, q_pos], None if docs is None else docs[:, k_pos],
                      window, causal=src == rank)
    if layout.masked is None and mask is not None and not bool(mask.any()):
        return None
    return q_rows, k_rows, mask


# -- ring attention (p2p) ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ring:
    """A CP group as a ring: this rank's position and its neighbours' global ranks."""

    group: object
    size: int
    rank: int
    next_rank: int
    prev_rank: int


def _pack(k: Tensor, v: Tensor) -> Tensor:
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(flat: Tensor, k_like: Tensor, v_like: Tensor) -> tuple[Tensor, Tensor]:
    n = k_like.numel()
    return flat[:n].view_as(k_like), flat[n:].view_as(v_like)


class _RingAttention(torch.autograd.Function):
    """q [b, H, s, d], k/v [b, G, s, d*] (this rank's zigzag chunks, H = G * hpg) -> out [b, H, s, dv]."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, hpg: int, scale: float, window: int | None,
                layout: AttentionLayout, ring: Ring) -> Tensor:
        b, H, s, d = q.shape
        G = k.shape[1]
        q5 = q.float().view(b, G, hpg, s, d)
        out = torch.zeros(b, G, hpg, s, v.shape[-1], device=q.device)
        lse = torch.full((b, G, hpg, s), float("-inf"), device=q.device)
        kf, vf = k.float().contiguous(), v.float().contiguous()
        flat = _pack(kf, vf)
        for t in range(ring.size):
            src = (ring.rank - t) % ring.size
            pending = None
            if t < ring.size - 1:  # the next block travels while this one is computed: one batch, send and receive
                pending = p2p.post([(flat, ring.next_rank)], [(torch.empty_like(flat), ring.prev_rank)], ring.group)
            block = ring_block(layout, ring.rank, src, window, q.device)
            if block is not None:
                qr, kr, mask = block
                kb, vb = _unpack(flat, kf, vf)
                o, l = _block_forward(q5[:, :, :, qr], kb[:, :, None, kr], vb[:, :, None, kr], mask, scale)
                out[:, :, :, qr], lse[:, :, :, qr] = _merge(out[:, :, :, qr], lse[:, :, :, qr], o, l)
            if pending is not None:
                (flat,) = pending.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.hpg, ctx.scale, ctx.window, ctx.layout, ctx.ring = hpg, scale, window, layout, ring
        return out.view(b, H, s, -1).to(q.dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, layout, hpg, scale, window = ctx.ring, ctx.layout, ctx.hpg, ctx.scale, ctx.window
        b, H, s, d = q.shape
        G = k.shape[1]
        q5 = q.float().view(b, G, hpg, s, d)
        do5 = grad.float().reshape(b, G, hpg, s, -1)
        delta = (do5 * out).sum(dim=-1)
        dq = torch.zeros_like(q5)
        kf, vf = k.float().contiguous(), v.float().contiguous()
        flat = _pack(kf, vf)
        # Step t computes the block of rank (rank - t) and adds its dK/dV to the accumulator of that block, which
        # arrives from the previous rank and goes on to the next. One batch per step, posted before the step's work:
        # send the K/V block on and the previous step's accumulator on, receive the next K/V block and this step's
        # accumulator; the same order on every rank, so a pair's messages in one direction always match (no tags).
        # After the last step one more batch brings each rank's own accumulator home.
        size = ring.size
        acc = None
        for t in range(size):
            src = (ring.rank - t) % size
            sends, recvs = [], []
            if t < size - 1:
                sends.append((flat, ring.next_rank))
                recvs.append((torch.empty_like(flat), ring.prev_rank))
            if t > 0:
                sends.append((acc, ring.next_rank))
                recvs.append((torch.empty(kf.numel() + vf.numel(), device=q.device), ring.prev_rank))
            pending = p2p.post(sends, recvs, ring.group) if sends else None
            kb, vb = _unpack(flat, kf, vf)
            dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
            block = ring_block(layout, ring.rank, src, window, q.device)
            if block is not None:
                qr, kr, mask = block
                gq, gk, gv = _block_backward(q5[:, :, :, qr], kb[:, :, None, kr], vb[:, :, None, kr], mask, scale,
                                             lse[:, :, :, qr], do5[:, :, :, qr], delta[:, :, :, qr])
                dq[:, :, :, qr] += gq
                dk[:, :, kr] += gk
                dv[:, :, kr] += gv
            got = pending.wait() if pending is not None else []
            acc = _pack(dk, dv)
            if t > 0:
                acc = acc + got[-1]
            if t < size - 1:
                flat = got[0]
        if size > 1:  # our own block's accumulator, home after going round
            (acc,) = p2p.exchange([(acc, ring.next_rank)], [(torch.empty_like(acc), ring.prev_rank)], ring.group)
        dk_all, dv_all = _unpack(acc, kf, vf)
        return (dq.view(b, H, s, d).to(q.dtype), dk_all.to(k.dtype), dv_all.to(v.dtype), None, None, None, None,
                None)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, hpg: int, scale: float, window: int | None,
                   layout: AttentionLayout, ring: Ring) -> Tensor:
    """Causal attention of this CP rank's zigzag chunks against the whole sequence, K/V passed round the ring."""
    return _RingAttention.apply(q, k, v, hpg, scale, window, layout, ring)


# -- all-gather K/V ----------------------------------------------------------------------------------------------------

def gather_kv(x: Tensor, layout: AttentionLayout, group) -> Tensor:
    """[b, G, s_local, d] zigzag-local -> [b, G, S, d] in global order (autograd: all-gather, backward
    reduce-scatter)."""
    full = comm.gather_seq(x.transpose(1, 2), group).transpose(1, 2)  # rank-ordered local sequences
    b, G, S, d = full.shape
    cp = layout.cp
    order = torch.tensor(zigzag_order(cp), device=x.device)
    return full.view(b, G, 2 * cp, S // (2 * cp), d).index_select(2, order).reshape(b, G, S, d)


def all_gather_attention(q: Tensor, k: Tensor, v: Tensor, hpg: int, scale: float, window: int | None,
                         layout: AttentionLayout, group, backend: str) -> Tensor:
    """All-gather K/V over CP, then each local query chunk attends to the key prefix ending with it."""
    K, V = gather_kv(k, layout, group), gather_kv(v, layout, group)
    c = layout.chunk
    outs = []
    for qi, qc in enumerate(zigzag_chunks(layout.cp, layout.cp_rank)):
        end = (qc + 1) * c
        docs_q = layout.chunk_docs(qc)
        docs_k = None if layout.docs is None else layout.docs[:, :end]
        outs.append(prefix_attention(q[:, :, qi * c:(qi + 1) * c], K[:, :, :end], V[:, :, :end], hpg, scale, window,
                                     docs_q, docs_k, backend, lambda qc=qc, end=end: layout.varlen(qc, end)))
    return torch.cat(outs, dim=2)


# -- local attention: SDPA or flash-attn -------------------------------------------------------------------------------

def prefix_attention(q: Tensor, k: Tensor, v: Tensor, hpg: int, scale: float | None, window: int | None,
                     docs_q: Tensor | None, docs_k: Tensor | None, backend: str,
                     pack: Callable[[], "VarlenPack"] | None = None) -> Tensor:
    """Causal attention of queries [b, H, sq, d] that are the last sq tokens of the keys [b, G, sk, d] (bottom-right
    aligned), within documents and the sliding window. `pack`: the varlen segments of docs_q/docs_k (flash-attn's
    packed path; default: built here from the ids)."""
    if backend == "flash" and q.shape[-1] == v.shape[-1]:
        return _flash_prefix(q, k, v, scale, window, docs_q, docs_k, pack)
    sq, sk = q.shape[2], k.shape[2]
    if docs_q is None and window is None and sq == sk:
        return gqa_attention(q, k, v, is_causal=True, scale=scale)
    k_pos = torch.arange(sk, device=q.device)
    mask = block_mask(k_pos[sk - sq:], k_pos, docs_q, docs_k, window)
    return gqa_attention(q, k, v, mask, scale=scale)


def _flash_prefix(q: Tensor, k: Tensor, v: Tensor, scale: float | None, window: int | None, docs_q: Tensor | None,
                  docs_k: Tensor | None, pack: Callable[[], "VarlenPack"] | None = None) -> Tensor:
    """flash-attn (causal aligned bottom-right since 2.1; GQA native, query heads group-major as ours). The tests
    check these calls against a stand-in module with flash-attn's semantics; the CUDA kernel itself was not run."""
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    window_size = (window - 1, 0) if window is not None else (-1, -1)
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # [b, s, heads, d]
    if docs_q is None:
        out = flash_attn_func(qt, kt, vt, causal=True, softmax_scale=scale, window_size=window_size)
        return out.transpose(1, 2)
    b, sq, H, d = qt.shape
    pack = pack() if pack is not None else varlen_pack(docs_q, docs_k)
    qf = qt.reshape(b * sq, H, d)
    kf = kt.reshape(-1, *kt.shape[2:]).index_select(0, pack.k_index)
    vf = vt.reshape(-1, *vt.shape[2:]).index_select(0, pack.k_index)
    out = flash_attn_varlen_func(qf, kf, vf, pack.cu_q, pack.cu_k, pack.max_q, pack.max_k, causal=True,
                                 softmax_scale=scale, window_size=window_size)
    return out.view(b, sq, H, -1).transpose(1, 2)


@dataclass(frozen=True)
class VarlenPack:
    cu_q: Tensor  # int32 [segments + 1]
    cu_k: Tensor
    max_q: int
    max_k: int
    k_index: Tensor  # rows of the flattened [b * sk] keys that take part, in segment order


def varlen_pack(docs_q: Tensor, docs_k: Tensor) -> VarlenPack:
    """cu_seqlens for queries that are the last sq tokens of the keys, one segment per (row, document): each
    document's queries attend to its keys up to themselves (flash-attn's bottom-right causal). Keys of documents that
    end before the first query are left out. Document ids are non-decreasing along a row."""
    b, sk = docs_q.shape[0], docs_k.shape[1]
    cu_q, cu_k, k_index = [0], [0], []
    for row in range(b):
        first, last = int(docs_q[row, 0]), int(docs_q[row, -1])
        keep = (docs_k[row] >= first).nonzero().squeeze(1)
        n_q = torch.bincount(docs_q[row] - first, minlength=last - first + 1)
        n_k = torch.bincount(docs_k[row, keep] - first, minlength=last - first + 1)
        for a, bk in zip(n_q.tolist(), n_k.tolist()):
            cu_q.append(cu_q[-1] + a)
            cu_k.append(cu_k[-1] + bk)
        k_index.append(keep + row * sk)
    dev = docs_q.device
    qs = torch.tensor(cu_q, dtype=torch.int32, device=dev)
    ks = torch.tensor(cu_k, dtype=torch.int32, device=dev)
    return VarlenPack(qs, ks, int((qs[1:] - qs[:-1]).max()), int((ks[1:] - ks[:-1]).max()), torch.cat(k_index))


def select_backend(device: torch.device, dtype: torch.dtype) -> tuple[str, str]:
    """("flash" | "sdpa", why): flash-attn when installed, on CUDA, in bf16/fp16."""
    if device.type != "cuda":
        return "sdpa", "torch SDPA (flash-attn needs CUDA)"
    if dtype not in (torch.bfloat16, torch.float16):
        return "sdpa", "torch SDPA (flash-attn needs bf16/fp16)"
    try:
        import flash_attn
    except ImportError:
        return "sdpa", "torch SDPA (flash-attn is not installed)"
    return "flash", f"flash-attn {getattr(flash_attn, '__version__', '?')}"


# -- hooking it onto the model -----------------------------------------------------------------------------------------

class AttentionState:
    """The installed attention of one model (stage): CP group, backend, and the layout of the micro-batch being run.
    StageStep sets the layout around a forward (`use`); full-layer recompute restores it with `recompute_context`
    (torch.utils.checkpoint's context_fn), so a recomputed layer sees its own micro-batch under 1F1B."""

    def __init__(self, cp: int, cp_rank: int, ring: Ring | None, comm_type: str, backend: str, recompute: bool):
        self.cp, self.cp_rank, self.ring = cp, cp_rank, ring
        self.comm_type, self.backend, self.recompute = comm_type, backend, recompute
        self.current: AttentionLayout | None = None

    @contextlib.contextmanager
    def use(self, layout: AttentionLayout):
        prev, self.current = self.current, layout
        try:
            yield
        finally:
            self.current = prev

    def recompute_context(self):
        return contextlib.nullcontext(), self.use(self.current)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, hpg: int, scale: float, window: int | None,
               layout: AttentionLayout) -> Tensor:
        """q [b, H, s, d]; k/v [b, G, s, d*] (one head per query group)."""
        if self.cp == 1:
            return prefix_attention(q, k, v, hpg, scale, window, layout.docs, layout.docs, self.backend,
                                    lambda: layout.varlen())
        if self.comm_type == "all_gather":
            return all_gather_attention(q, k, v, hpg, scale, window, layout, self.ring.group, self.backend)
        return ring_attention(q, k, v, hpg, scale, window, layout, self.ring)

    def core_attention_for(self, module: nn.Module) -> Callable:
        """A replacement for module.core_attention(q, k, v, mask) (mask is recomputed from global positions)."""
        hpg = getattr(module, "heads_per_group", 1)
        window = getattr(module, "sliding_window", None)
        scale = getattr(module, "softmax_scale", None) or 1.0 / math.sqrt(module.head_dim)

        def core_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
            layout = self.current
            if layout is None:
                raise RuntimeError("context-parallel attention called outside StageStep (no micro-batch layout)")
            if self.recompute:
                return checkpoint(self.attend, q, k, v, hpg, scale, window, layout, use_reentrant=False)
            return self.attend(q, k, v, hpg, scale, window, layout)

        return core_attention


def cp_ring(groups) -> Ring | None:
    dims = groups.dims
    if dims.cp == 1:
        return None
    at = {"tp": groups.tp_rank, "dp": groups.dp_rank, "pp": groups.pp_rank}
    r = groups.cp_rank
    return Ring(groups.cp, dims.cp, r, dims.rank(cp=(r + 1) % dims.cp, **at), dims.rank(cp=(r - 1) % dims.cp, **at))


def attention_state(groups, comm_type: str, packing: Packing, recompute_selective: bool, device: torch.device,
                    dtype: torch.dtype) -> tuple[AttentionState | None, str]:
    """The attention a run needs besides its model's own: (an AttentionState when CP > 1, packed-document masks are
    on or flash-attn is chosen, else None; one line saying what attention runs). The native engine hooks it onto its
    model (apply_context_parallel), the megatron-core engine into megatron-core's attention (its core attention)."""
    if comm_type not in COMM_TYPES:
        raise ConfigError(f"--cp-comm-type {comm_type!r}: expected one of {', '.join(COMM_TYPES)}")
    cp = groups.dims.cp
    backend, why = select_backend(device, dtype)
    if cp > 1 and comm_type == "p2p":
        line = f"attention: ring (p2p) over cp={cp}, plain-torch blocks; {why} not used in the ring"
    else:
        line = f"attention: {why}" + (f", K/V all-gathered over cp={cp}" if cp > 1 else "")
        if backend == "flash" and packing.reset_attention_mask:
            line += " (flash_attn_varlen_func for packed documents)"
    if cp == 1 and not packing.reset_attention_mask and backend == "sdpa":
        return None, line
    return AttentionState(cp, groups.cp_rank, cp_ring(groups), comm_type, backend, recompute_selective), line


def apply_context_parallel(model: nn.Module, groups, comm_type: str, packing: Packing, recompute_selective: bool,
                           device: torch.device, dtype: torch.dtype) -> tuple[AttentionState | None, str]:
    """Replace every attention layer's core_attention when CP > 1, packed-document masks are on or flash-attn is
    chosen (`attention_state`); the model is left as built otherwise. Returns (state or None, the attention line)."""
    state, line = attention_state(groups, comm_type, packing, recompute_selective, device, dtype)
    if state is None:
        return None, line
    mtp = [] if getattr(model, "mtp", None) is None else [m.transformer_layer for m in model.mtp.layers]
    for layer in [*model.decoder.layers.values(), *mtp]:  # the MTP layers' attention sees the same split and documents
        att = layer.self_attention
        att.core_attention = state.core_attention_for(att)
    return state, line
