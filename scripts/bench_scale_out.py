#!/usr/bin/env python3
"""Benchmark `convert hf-to-mcore` as one process vs several ranks on this host (issue 20).

One host shares one disk among its ranks, so this shows the cost of the multi-rank machinery (torchrun, the
rendezvous, torch imported by every rank, the share, the reports), not a speed-up; the speed-up comes from nodes that
each bring their own read and write bandwidth. From the measured rates the script prints a projection for N nodes.

    .venv/bin/python scripts/bench_scale_out.py --size-gb 0.5 --ranks 1,2 --repeats 3 [--nodes 8]

Synthesizes a Llama-3-shaped bf16 checkpoint with scripts/bench_convert.py's generator, then for each repeat and rank
count converts it (`--tp 2 --pp 2 --quiet`; several ranks through `torchrun --standalone`) into a fresh output, with
the source's page-cache pages evicted first (or the whole cache dropped where allowed; the code, torch included, is
read again untimed), and checks that every output
is byte-identical to the one-process output. Prints one line per rank count: median seconds and GB/s.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_convert import GB, WARM_CODE, dir_bytes, evict, run_dir, shape_for, synthesize, try_drop_caches  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def digest(root: Path) -> str:
    """Every chunk and array file of a converted iteration (the manifest's time-dependent provenance left out)."""
    h = hashlib.sha256()
    it = root / "iter_0000000"
    for p in sorted(it.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            h.update(str(p.relative_to(it)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def convert(src: Path, out: Path, ranks: int) -> float:
    argv = ["convert", "hf-to-mcore", str(src), str(out), "--tp", "2", "--pp", "2", "--quiet", "--no-verify"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if ranks == 1:
        cmd = [sys.executable, "-m", "shardkit", *argv]
    else:
        cmd = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", str(ranks),
               "-m", "shardkit", *argv]
    t = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--nodes", type=int, default=8, help="nodes of the projection (default 8)")
    ap.add_argument("--workdir", default=None, help="a fresh directory is made inside it, used and removed")
    args = ap.parse_args()
    work = run_dir(args.workdir, "bench-scale-out-")
    src = work / "hf"
    try:
        shape = shape_for(args.size_gb, args.hidden, None, 2, vocab=32000)
        synthesize(src, shape, 256 << 20)
        nbytes = dir_bytes(src)
        cold = try_drop_caches()
        print(f"model: {shape.describe()}; cache: {'dropped' if cold else 'source evicted'} before each run; "
              f"{os.cpu_count()} CPUs")
        counts = [int(x) for x in args.ranks.split(",")]
        times: dict[int, list[float]] = {n: [] for n in counts}
        want = None
        for rep in range(args.repeats):
            for n in counts:  # interleaved: the same load for every rank count
                out = work / f"out-{n}"
                if not try_drop_caches():
                    evict([src])
                # the code (torch for the ranks) is read untimed: the runs pay for the model's bytes, not for
                # reading torch's libraries from a cold disk
                subprocess.run([sys.executable, "-c", f"{WARM_CODE}, torch.distributed"], check=True,
                               env=dict(os.environ, PYTHONPATH=str(REPO)))
                times[n].append(convert(src, out, n))
                d = digest(out)
                want = want or d
                if d != want:
                    raise SystemExit(f"{n} ranks wrote other bytes than the first run")
                shutil.rmtree(out)
        base = statistics.median(times[counts[0]])
        for n in counts:
            m = statistics.median(times[n])
            print(f"{n} rank(s): {m:.2f} s median of {len(times[n])} ({nbytes / GB / m:.3f} GB/s), "
                  f"{m / base:.2f}x the {counts[0]}-rank time; runs {', '.join(f'{t:.2f}' for t in times[n])}; "
                  "outputs byte-identical")
        per_node = nbytes / GB / base
        print(f"projection: {args.nodes} nodes at the measured {per_node:.3f} GB/s each (one node's rate here) "
              f"convert {args.nodes * per_node:.2f} GB/s: a 1.3 TB checkpoint in "
              f"{1300 / (args.nodes * per_node) / 60:.0f} min (bounded by the shared filesystem's aggregate rate)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
