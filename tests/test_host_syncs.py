"""Device-to-host synchronisations of a training step (issue 32).

On a GPU every read of device data by the host stalls the host until the device has caught up: the kernels queued
behind it no longer overlap the host's Python, and a pipeline stage stops feeding its peers. The trainer keeps them to
a fixed few per step, whatever the number of micro-batches, layers or experts; MoE dispatch reads one tensor of counts
per MoE layer per micro-batch forward (as megatron-core's alltoall dispatcher reads tokens-per-expert once per layer).

What counts as a sync here (counted on the CPU, where each of these would be one on a GPU; tests/test_host_syncs.py
patches them on torch.Tensor / torch while the steady-state iterations 2..N run, start-up and saves excluded):

    explicit reads   .item() .tolist() .cpu() .numpy() .to("cpu") and bool()/int()/float()/index of a tensor (a
                     tensor in an `if`, `not t`, `range(t)`, `x[:t]`), torch.equal / allclose / is_nonzero,
                     torch.cuda.synchronize
    hidden reads     ops whose output size depends on the data, which CUDA must read back before it allocates:
                     nonzero / argwhere / one-argument torch.where, boolean-mask indexing, masked_select, unique,
                     repeat_interleave with tensor repeats and no output_size, and bincount (its CUDA kernel reads the
                     input's max to size the output)
    not counted      host-to-device copies (the data's micro-batches, torch.tensor(list, device=...)), collectives
                     (NCCL runs them on the device stream)

Measured per step (iterations 2..4 of `continue-pretrain` in this process, tiny models, --log-interval 1; every
steady-state step alike); "a + b": a per step, b in the MoE layers (per MoE layer per micro-batch forward x layers x
micro-batches; DeepSeek-V3's MTP layer is an MoE layer, its first layer is dense):

    model          layers  experts  micro-batches       before (commit 7c64a70)      after
    Llama          2 or 4  -        1 or 4              6                            1
    Mixtral        2       4        1                   11 + 10 = 21                 1 + 2 = 3
    Mixtral        2       4        4                   11 + 40 = 51                 1 + 8 = 9
    Mixtral        4       4        1                   15 + 20 = 35                 1 + 4 = 5
    Mixtral        2       8        1                   11 + 18 = 29                 1 + 2 = 3
    DeepSeek-V3    2       4        1                   14 + 10 = 24                 1 + 2 = 3
    DeepSeek-V3    2       4        4                   14 + 40 = 54                 1 + 8 = 9
    DeepSeek-V3    4       4        1                   18 + 20 = 38                 1 + 4 = 5
    DeepSeek-V3    2       8        1                   14 + 18 = 32                 1 + 2 = 3
    DeepSeek-V3    2       4        4, full recompute   14 + 56 = 70                 1 + 8 = 9
    Mixtral EP 2 (2 ranks, DP 2), 2 per rank, alltoall  12 + 24 = 36 on each rank    1 + 4 = 5
    Mixtral EP 2 (2 ranks, DP 2), 2 per rank, allgather 12 + 16 = 28 on each rank    1 + 4 = 5

Before: per step, the loop's 6 (own-gradient and loss finiteness `bool`s, the any-rank-bad flags, the loss `float`,
the grad norm `float` for clipping, the log line's peak-memory `float`) and MoETraining.finish_step's 2 per layer slot
(`counts.sum() > 0`, the imbalance `float`), 1 for the balancing loss, 1 + 1 per depth for MTP, 1 for the all-to-all
seconds (EP > 1). Per MoE layer per micro-batch: the router statistics' bincount, and the dispatch: at EP 1 the
model's loop, one `torch.where` (nonzero) per expert; at EP 2 alltoall 5 (bincount, 3 `.tolist()`, repeat_interleave
without output_size); allgather 3 (where, bincount, `.tolist()`); a recomputed forward read it all again.

After: per step ONE read (train/loop.py `Trainer._read_step`): the loss, every rank's NaN flags, the squared gradient
norm (clipping then scales exactly as before, on the host's float), the peak memory over ranks and the MoE
statistics (MoETraining.reduce_stats: per-slot loads and imbalance, balancing and MTP losses, all-to-all seconds)
travel in one float64 tensor and one `.tolist()`, before the optimizer step (a non-finite state is still never
applied). Per MoE layer per micro-batch forward ONE `.tolist()` (train/parallel/expert.py `HostCounts`): the
all-to-all splits, expert-TP sizes and per-expert rows together; counts by scatter_add; at EP 1 `LocalExperts` runs
the model's loop over one sort; a recompute takes its forward's counts back (0 more).

Numbers are unchanged bitwise: scripts/bytecheck.py on 7c64a70 and on the change, 0 differences over 929 entries
(conversions, 8 trainings: TP+SP, PP, VPP, full recompute, Mixtral EP 2, DeepSeek-V3 EP 1, CP 2); and every logged
value (loss, grad norm, load imbalance, balancing / MTP losses) and saved tensor of 8 MoE trainings (DeepSeek-V3 EP 1
with and without full recompute, EP 2 + full recompute; Mixtral EP 1 without clipping, EP 2 alltoall and allgather,
TP 2 + ETP 2, TP 2 x EP 2 x ETP 2) identical, 0 differences over 518 entries.

Not in these paths, left: --exit-signal-handler's check (train/signals.py, 2 reads per step), packed documents'
attention layout under CP (train/parallel/context.py), evaluation (1 per evaluation), saves.
"""
from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()

# -- the counter --------------------------------------------------------------------------------------------------------

_TENSOR_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "equal",
                 "allclose", "is_nonzero", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive",
                 "bincount")
_TORCH_READS = ("equal", "allclose", "is_nonzero", "nonzero", "argwhere", "masked_select", "unique",
                "unique_consecutive", "bincount")


def _is_cpu(d) -> bool:
    return (isinstance(d, str) and d.split(":")[0] == "cpu") or (isinstance(d, torch.device) and d.type == "cpu")


def _to_host(self, *a, **k) -> bool:
    """Tensor.to(...) towards the host; the data loader's micro-batches (marked `_host`) start there."""
    if getattr(self, "_host", False):
        return False
    return any(_is_cpu(x) for x in (*a, k.get("device")))


def _mask_index(self, idx) -> bool:
    items = idx if isinstance(idx, tuple) else (idx,)
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in items)


def _repeats_tensor(*a, **k) -> bool:
    reps = a[1] if len(a) > 1 else k.get("repeats")
    return isinstance(reps, torch.Tensor) and k.get("output_size") is None


class SyncCounter:
    """While `active`, every call of a sync entry point outside another one is counted in `steps[-1]`, keyed by the
    first frame of this repository's code that made it ("train/parallel/expert.py:forward item")."""

    def __init__(self) -> None:
        self.active = False
        self.depth = 0
        self.steps: list[collections.Counter] = []
        self._undo: list[tuple[object, str, object, bool]] = []

    def _site(self) -> str:
        f = sys._getframe(2)
        while f is not None:
            p = Path(f.f_code.co_filename)
            if p != HERE and REPO in p.parents and ".venv" not in p.parts:
                return f"{p.relative_to(REPO)}:{f.f_code.co_name}"
            f = f.f_back
        return "<torch>"

    def _wrap(self, owner, name: str, test=None) -> None:
        orig = getattr(owner, name)
        counter = self

        def f(*a, **k):
            if counter.active and not counter.depth and (test is None or test(*a, **k)):
                counter.steps[-1][f"{counter._site()} {name}"] += 1
            counter.depth += 1
            try:
                return orig(*a, **k)
            finally:
                counter.depth -= 1

        self._undo.append((owner, name, owner.__dict__.get(name), name in owner.__dict__))
        setattr(owner, name, f)

    def install(self) -> "SyncCounter":
        for name in _TENSOR_READS:
            self._wrap(torch.Tensor, name)
        for name in _TORCH_READS:
            self._wrap(torch, name)
        self._wrap(torch.Tensor, "to", _to_host)
        self._wrap(torch.Tensor, "__getitem__", _mask_index)
        self._wrap(torch.Tensor, "repeat_interleave", _repeats_tensor)
        self._wrap(torch, "repeat_interleave", _repeats_tensor)
        self._wrap(torch, "where", lambda *a, **k: len(a) + len(k) == 1)
        self._wrap(torch.cuda, "synchronize")
        return self

    def uninstall(self) -> None:
        for owner, name, old, had in reversed(self._undo):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)
        self._undo.clear()

    def start_step(self) -> None:
        self.steps.append(collections.Counter())
        self.active = True


@contextlib.contextmanager
def counting():
    c = SyncCounter().install()
    try:
        yield c
    finally:
        c.uninstall()


# -- a real trainer, in this process -------------------------------------------------------------------------------

ITERS = 4  # iterations 2..4 are counted


def _argv(ck: Path, data: Path, micro: int, extra: list[str], dp: int = 1) -> list[str]:
    """`micro` micro-batches of one sample per data-parallel rank."""
    return ["--load", str(ck), "--data-path", str(data), "--seq-length", "32", "--micro-batch-size", "1",
            "--global-batch-size", str(micro * dp), "--lr", "1e-3", "--lr-warmup-iters", "1", "--min-lr", "1e-4",
            "--clip-grad", "1.0", "--seed", "7", "--train-iters", str(ITERS), "--log-interval", "1", *extra]


def count_steps(argv: list[str], counter: SyncCounter) -> list[collections.Counter]:
    """Run `continue-pretrain argv` on this process's (initialised) process group; the counts of iterations 2..N."""
    import argparse

    import train.loop as loop
    from train.config import add_arguments, from_namespace

    p = argparse.ArgumentParser()
    add_arguments(p)
    trainer = loop.Trainer(from_namespace(p.parse_args(argv)))
    step, final = trainer.train_step, trainer.final_line

    def train_step(batches):
        if trainer.iteration >= 1:  # iteration 2 on: start-up (iteration 1: optimizer state, first calls) excluded
            counter.start_step()
        return step(batches)

    def final_line():
        counter.active = False
        return final()

    def micro_batches(*a, **k):
        for s in real_micro_batches(*a, **k):
            s._host = True  # the data's own host-to-device copy is not a sync
            yield s

    real_micro_batches = loop.micro_batches
    trainer.train_step, trainer.final_line = train_step, final_line
    loop.micro_batches = micro_batches
    counter.steps.clear()
    try:
        trainer.run(log=lambda *_: None)
    finally:
        loop.micro_batches = real_micro_batches
        counter.active = False
    assert len(counter.steps) == ITERS - 1
    return list(counter.steps)


@contextlib.contextmanager
def one_rank():
    import torch.distributed as dist

    from train.loop import init_distributed

    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    init_distributed(5)
    try:
        yield
    finally:
        dist.destroy_process_group()
        os.environ.update(env)


# -- the checkpoints -------------------------------------------------------------------------------------------------

MOE_FLAGS = {
    "mixtral": ["--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "0.01"],
    "deepseek_v3": ["--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
                    "--moe-router-bias-update-rate", "0.01", "--mtp-loss-scaling-factor", "0.3"],
    "llama": [],
}


def build_checkpoint(root: Path, kind: str, layers: int, experts: int) -> Path:
    from shardkit.cli import main as cli

    name = f"{kind}-l{layers}-e{experts}"
    ck = root / f"{name}-ck"
    if (ck / "latest").exists():
        return ck
    hf = root / f"{name}-hf"
    if kind == "llama":
        from shardkit.demo import build_tiny_llama

        build_tiny_llama(hf, dtype=torch.float32, num_hidden_layers=layers, hidden_size=64, intermediate_size=96,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    else:
        from tests import moe_models

        if kind == "mixtral":
            over = {"num_local_experts": experts}
        else:  # groups of 2 experts (its group score is the top-2 sum), half of them kept
            over = {"n_routed_experts": experts, "n_group": experts // 2, "topk_group": experts // 4}
        moe_models.build(kind, hf, num_hidden_layers=layers, **over)
    assert cli(["convert", "hf-to-mcore", str(hf), str(ck), "--quiet", "--no-verify"]) == 0
    return ck


def moe_slots(kind: str, layers: int) -> int:
    """MoE layers a forward runs through: Mixtral's every layer; DeepSeek-V3's all but the first, plus its MTP layer."""
    return {"llama": 0, "mixtral": layers, "deepseek_v3": layers - 1 + 1}[kind]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from tests.corpus import write_pattern_corpus

    root = tmp_path_factory.mktemp("host_syncs")
    write_pattern_corpus(root / "data")
    return root


def split(step: collections.Counter) -> tuple[int, int]:
    """(syncs of the MoE dispatch, all the others) of one step."""
    dispatch = sum(n for k, n in step.items() if k.startswith("train/parallel/expert.py"))
    return dispatch, sum(step.values()) - dispatch


# the loop's one read per step (loss, NaN flags, grad norm, peak memory, MoE statistics)
STEP_BUDGET = 1
# per MoE layer per micro-batch forward (recompute and backward add none)
DISPATCH_BUDGET = 1

CASES = [  # (kind, layers, experts, micro-batches, extra flags)
    ("llama", 2, 0, 1, []), ("llama", 2, 0, 4, []), ("llama", 4, 0, 1, []),
    ("mixtral", 2, 4, 1, []), ("mixtral", 2, 4, 4, []), ("mixtral", 4, 4, 1, []), ("mixtral", 2, 8, 1, []),
    ("deepseek_v3", 2, 4, 1, []), ("deepseek_v3", 2, 4, 4, []), ("deepseek_v3", 4, 4, 1, []),
    ("deepseek_v3", 2, 8, 1, []),
    ("deepseek_v3", 2, 4, 4, ["--recompute-granularity", "full"]),
]


def _id(c) -> str:
    kind, layers, experts, micro, extra = c
    return f"{kind}-l{layers}" + (f"-e{experts}" if experts else "") + f"-mb{micro}" + \
        ("-recompute" if extra else "")


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_syncs_per_step_are_fixed(root, case):
    kind, layers, experts, micro, extra = case
    ck = build_checkpoint(root, kind, layers, experts)
    with one_rank(), counting() as c:
        steps = count_steps(_argv(ck, root / "data", micro, [*MOE_FLAGS[kind], *extra]), c)
    report = {k: n for k, n in steps[-1].items()}
    assert all(s == steps[0] for s in steps), steps  # every steady-state step alike
    dispatch, rest = split(steps[0])
    assert rest == STEP_BUDGET, report
    assert dispatch == DISPATCH_BUDGET * micro * moe_slots(kind, layers), report


def test_local_experts_are_the_model_loop_bitwise():
    """EP 1's LocalExperts (one sort, one host read) gives model.Experts' outputs and gradients bit for bit, also when
    activation recompute re-runs it in the backward pass (two micro-batches in flight, each recompute taking its own
    forward's counts back)."""
    from torch.utils.checkpoint import checkpoint

    from checkpoint.config import ModelConfig
    from train.model import Experts
    from train.parallel.expert import LocalExperts

    cfg = ModelConfig(model_type="mixtral", num_layers=1, hidden_size=16, num_attention_heads=2, num_query_groups=2,
                      kv_channels=8, ffn_hidden_size=8, vocab_size=32, max_position_embeddings=8, norm_epsilon=1e-5,
                      rotary_base=10000.0, num_moe_experts=8, moe_ffn_hidden_size=8, moe_router_topk=2,
                      moe_layer_freq=[1])
    torch.manual_seed(0)
    ref = Experts(cfg)
    local = LocalExperts(ref)
    assert [n for n, _ in local.named_parameters()] == [n for n, _ in ref.named_parameters()]
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(12, 16, generator=g), torch.rand(12, 2, generator=g),
                torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(12)])) for _ in range(2)]

    def run(module, recompute: bool):
        module.zero_grad()
        outs, leaves = [], []
        for x, w, idx in batches:  # both forwards, then both backwards (1F1B's warm-up)
            x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = checkpoint(module, x, w, idx, use_reentrant=False) if recompute else module(x, w, idx)
            outs.append(y)
            leaves.append((x, w))
        for y in outs:
            y.pow(2).sum().backward()
        return ([y.detach() for y in outs], [t.grad for pair in leaves for t in pair],
                [p.grad.clone() for p in module.parameters()])

    want = run(ref, False)
    for recompute in (False, True):
        got = run(local, recompute)
        for a, b in zip(want, got):
            assert all(torch.equal(u, v) for u, v in zip(a, b)), recompute
    assert not local.host_counts.pending  # every recompute took its counts back


# -- expert parallelism: two ranks ---------------------------------------------------------------------------------

def _ep_worker(rank: int, world: int, store: str, out: str, ck: str, data: str, micro: int) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=3))
    res = {}
    try:
        for dispatcher in ("alltoall", "allgather"):
            with counting() as c:
                steps = count_steps(_argv(Path(ck), Path(data), micro, [*MOE_FLAGS["mixtral"], "--ep", "2",
                                                                        "--moe-token-dispatcher-type", dispatcher],
                                    dp=2), c)
            res[dispatcher] = [dict(s) for s in steps]
    finally:
        dist.destroy_process_group()
    Path(out, f"{rank}.json").write_text(json.dumps(res))
    from tests.launcher import exit_worker

    exit_worker()


def test_expert_parallel_dispatch_one_sync_per_layer(root, tmp_path):
    """Mixtral at EP 2 (DP 2) on two ranks, both token dispatchers: the same budgets on each rank."""
    import torch.multiprocessing as mp

    ck = build_checkpoint(root, "mixtral", 2, 4)
    micro = 2  # per DP rank
    mp.start_processes(_ep_worker, args=(2, str(tmp_path / "store"), str(tmp_path), str(ck), str(root / "data"),
                                         micro),
                       nprocs=2, start_method="spawn")
    for rank in range(2):
        res = json.loads((tmp_path / f"{rank}.json").read_text())
        for dispatcher, steps in res.items():
            steps = [collections.Counter(s) for s in steps]
            assert all(s == steps[0] for s in steps), (rank, dispatcher, steps)
            dispatch, rest = split(steps[0])
            assert rest == STEP_BUDGET, (rank, dispatcher, steps[0])
            assert dispatch == DISPATCH_BUDGET * micro * moe_slots("mixtral", 2), (rank, dispatcher, steps[0])


if __name__ == "__main__":  # print the counts of every case: python tests/test_host_syncs.py DIR
    import tempfile

    from tests.corpus import write_pattern_corpus

    r = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp())
    if not (r / "data.bin").exists():
        write_pattern_corpus(r / "data")
    for case in CASES:
        kind, layers, experts, micro, extra = case
        ck = build_checkpoint(r, kind, layers, experts)
        with one_rank(), counting() as c:
            steps = count_steps(_argv(ck, r / "data", micro, [*MOE_FLAGS[kind], *extra]), c)
        d, rest = split(steps[-1])
        print(_id(case), "dispatch", d, "rest", rest, "per step", [sum(s.values()) for s in steps])
        for k, n in sorted(steps[-1].items()):
            print("   ", n, k)
