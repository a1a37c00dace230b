#!/usr/bin/env python3
"""Training saves to object storage against local disk, in the same run (issue 38).

`shardkit continue-pretrain` under torchrun (gloo, CPU) trains a Llama-shaped model (fp32, `--hidden`, `--layers`,
`--vocab`) for one iteration and saves it (weights and the three fp32 optimizer states: 16 bytes a parameter),
alternately to a local `--save` and to `s3://bench/...` on a loopback S3 server this script starts (moto's server
mode, objects in memory, in this process), `--repeats` times each. The trainer's own line `saved checkpoint
iteration 1 in S s` is the time of one save: on local disk the chunk files written and fsynced and the commit; on
S3 every rank's chunk objects put straight from memory (no local copy) and rank 0's manifest and `latest`
(train/checkpointing.py `_save_to_store`). Reported: the median save time of each, the bytes saved and the ratio.
moto is a floor for what a real S3 endpoint does (Python, one process), not a measure of it.

    .venv/bin/python scripts/bench_object_storage.py --nproc 2 --hidden 1024 --layers 8 --repeats 3

Disk: the source checkpoint and one local save at a time, under a fresh directory in --workdir, removed at the end.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def saved_seconds(out: str) -> float:
    m = re.search(r"saved checkpoint iteration 1 in ([0-9.]+) s", out)
    if m is None:
        raise SystemExit(f"no 'saved checkpoint' line in the run's output:\n{out[-3000:]}")
    return float(m.group(1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc-per-node; default 2)")
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2: each rank its own chunks)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workdir", default=tempfile.gettempdir())
    args = ap.parse_args()

    import boto3
    import torch
    from moto.server import ThreadedMotoServer

    from shardkit.cli import main as cli
    from shardkit.demo import build_tiny_llama
    from tests.corpus import write_pattern_corpus

    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server: no line per request
    work = Path(tempfile.mkdtemp(prefix="bench-object-storage-", dir=args.workdir))
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = dict(os.environ, AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_ACCESS_KEY_ID="bench",
               AWS_SECRET_ACCESS_KEY="bench", AWS_REGION="us-east-1", SHARDKIT_STAGING=str(work / "staging"),
               OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    os.environ.update({k: env[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                           "AWS_REGION")})
    try:
        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1").create_bucket(Bucket="bench")
        heads = max(2, args.hidden // 64)
        hf = build_tiny_llama(work / "hf", dtype=torch.float32, hidden_size=args.hidden, num_hidden_layers=args.layers,
                              intermediate_size=args.hidden * 7 // 2 // 64 * 64, vocab_size=args.vocab,
                              num_attention_heads=heads, num_key_value_heads=2)
        assert cli(["convert", "hf-to-mcore", str(hf), str(work / "ck"), "--quiet", "--no-verify"]) == 0
        shutil.rmtree(hf)
        data = write_pattern_corpus(work / "data", docs=40)
        train = ["continue-pretrain", "--load", str(work / "ck"), "--data-path", str(data), "--seq-length", "32",
                 "--micro-batch-size", "1", "--global-batch-size", str(args.nproc // args.tp), "--train-iters", "1",
                 "--tensor-model-parallel-size", str(args.tp)]
        torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc-per-node", str(args.nproc),
                    "--master-addr", "127.0.0.1", "-m", "shardkit"]
        times: dict[str, list[float]] = {"local": [], "s3": []}
        nbytes = 0
        for i in range(args.repeats):
            for kind in ("local", "s3"):
                save = str(work / "save") if kind == "local" else f"s3://bench/run{i}"
                r = subprocess.run([*torchrun[:-2], "--master-port", str(free_port()), *torchrun[-2:], *train,
                                    "--save", save], env=env, capture_output=True, text=True, timeout=1800)
                if r.returncode:
                    raise SystemExit(f"{kind} run failed ({r.returncode}):\n{r.stderr[-3000:]}")
                times[kind].append(saved_seconds(r.stdout + r.stderr))
                if kind == "local":
                    nbytes = sum(p.stat().st_size for p in (work / "save" / "iter_0000001").rglob("*") if p.is_file())
                    shutil.rmtree(work / "save")
                print(f"[{i + 1}/{args.repeats}] {kind}: saved in {times[kind][-1]:.2f} s", flush=True)
        local, s3 = statistics.median(times["local"]), statistics.median(times["s3"])
        print(f"\nsave of {nbytes / 1e9:.3f} GB ({args.nproc} ranks, tp {args.tp}; hidden {args.hidden}, "
              f"{args.layers} layers, vocab {args.vocab}, fp32 + optimizer state), medians of {args.repeats}:")
        print(f"  local disk   {local:7.2f} s  {nbytes / 1e6 / local:8.1f} MB/s")
        print(f"  s3 (moto)    {s3:7.2f} s  {nbytes / 1e6 / s3:8.1f} MB/s  = {s3 / local:.2f}x local")
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
