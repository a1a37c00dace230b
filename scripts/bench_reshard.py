#!/usr/bin/env python
"""Benchmark `shardkit reshard` (native tp1pp1 -> tp4pp2) and native -> torch_dist against `cp -r` of the same
checkpoint, timed in the same run, with the peak RSS of each process tree (issue 4, "What must be measured").

The source is a synthetic LLaMA-shaped HF model (bench_convert's `synthesize` / `shape_for`) converted once, untimed,
to a native tp1pp1 checkpoint. Then, per repeat (interleaved, so drift on a shared disk hits all):
  (a) `cp -r` of that checkpoint, and the `sync` that makes its bytes durable (timed separately);
  (b) `shardkit reshard SRC DST --tp 4 --pp 2`;
  (c) `shardkit reshard SRC DST` (native -> native at the source's layout: the native baseline of (d) and (f));
  (d) `shardkit reshard SRC DST --format torch_dist` (native -> torch_dist at the same layout);
  (e) with --torch-dist-resharded: `... --tp 4 --pp 2 --format torch_dist` (reshard + export in one pass);
  (f) `shardkit reshard TD DST` (torch_dist -> native at the same layout; TD is (d)'s output, written once untimed).
Every torch_dist step is reported beside its native counterpart at the same layout (the "vs native" columns: wall and
CPU time ratios; issue 17's goal: within 1.3x, peak RSS unchanged). shardkit fsyncs what it writes, so compare with
cp+sync too. Cache mode as in bench_convert (cold when the page cache can be dropped, else the source files' pages
evicted before each step). Goal (issue 4): within 1.5x cp, peak RSS under 1.5 GB.

    .venv/bin/python scripts/bench_reshard.py --size 2 --markdown /tmp/reshard.md
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

# a sibling script: run as `python scripts/bench_reshard.py`, Python puts scripts/ first on sys.path
from bench_convert import (GB, MB, Cache, Code, Run, dir_bytes, machine_facts, median, run_dir, run_measured,
                           shape_for, shardkit_bin, synthesize, timed)


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=float, default=2.0, help="synthetic model size in GB (bf16 weights)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--tp", type=int, default=4, help="target TP of the reshard")
    p.add_argument("--pp", type=int, default=2, help="target PP of the reshard")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--workers", default=None, help="--workers passed to shardkit (default: its own)")
    p.add_argument("--torch-dist-resharded", action="store_true",
                   help="also time native tp1pp1 -> torch_dist at the target layout in one pass")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/shardkit-bench-reshard"))
    p.add_argument("--warm", action="store_true", help="do not drop the page cache (read the source warm)")
    p.add_argument("--poll", type=float, default=0.05, help="RSS sampling period, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--src", default="installed",
                   help="the shardkit tree to run: 'installed' (this checkout) or a directory (e.g. a `git archive` "
                        "snapshot), prepended to PYTHONPATH")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = run_dir(args.workdir, "run-")  # a fresh directory inside --workdir: only it is removed at the end
    cache = Cache.detect(args.warm)
    code = Code.parse(args.src)
    cache.codes = [code]  # re-read the code untimed after each cache drop
    sk = shardkit_bin()
    s = shape_for(args.size, args.hidden, None, args.pp, args.vocab)
    print(f"== {s.describe()}", flush=True)
    hf = work / "hf"
    synthesize(hf, s, int(0.5 * GB), seed=args.seed)
    src = work / "src"
    t0 = time.perf_counter()
    subprocess.run([sk, "convert", "hf-to-mcore", str(hf), str(src), "--quiet", *code.no_verify()], check=True,
                   env=code.env)
    shutil.rmtree(hf)
    src_bytes = dir_bytes(src)
    cache.sources = [src]
    print(f"   source checkpoint tp1pp1: {src_bytes / GB:.3f} GB (converted untimed in {time.perf_counter() - t0:.1f}s)",
          flush=True)
    extra = ["--workers", args.workers] if args.workers else []
    resharded = "reshard tp1pp1->tp%dpp%d" % (args.tp, args.pp)
    same = "native->native tp1pp1"
    td_src = work / "td-src"  # the import's source: native -> torch_dist at the same layout, untimed
    subprocess.run([sk, "reshard", str(src), str(td_src), "--quiet", "--format", "torch_dist"], check=True,
                   env=code.env)
    cache.sources = [src, td_src]
    # (label, source, flags, the native step at the same layout it is compared with)
    steps = [(resharded, src, ["--tp", str(args.tp), "--pp", str(args.pp)], None),
             (same, src, [], None),
             ("native->torch_dist tp1pp1", src, ["--format", "torch_dist"], same)]
    if args.torch_dist_resharded:
        steps.append((f"native tp1pp1->torch_dist tp{args.tp}pp{args.pp}", src,
                      ["--tp", str(args.tp), "--pp", str(args.pp), "--format", "torch_dist"], resharded))
    steps.append(("torch_dist->native tp1pp1", td_src, [], same))
    cps: list[tuple[float, float]] = []
    cp_cpu: list[float] = []  # user+sys seconds of cp: with other work on the CPUs, CPU time is the steadier measure
    runs: dict[str, list[Run]] = {label: [] for label, *_ in steps}
    out_bytes: dict[str, int] = {}
    loads: list[str] = []
    for rep in range(args.repeats):
        tag = f"   [{rep + 1}/{args.repeats}]"
        loads.append(uptime())
        dst = work / "cp"
        cache.before_step()
        cp = run_measured("cp -r", ["cp", "-r", str(src), str(dst)], args.poll, work / "cp.log")
        cp_s = cp.wall_s
        sync_s = timed(["sync"])
        cps.append((cp_s, sync_s))
        cp_cpu.append(cp.cpu_s)
        shutil.rmtree(dst)
        print(f"{tag} cp -r {cp_s:.2f}s ({src_bytes / GB / cp_s:.2f} GB/s, CPU {cp.cpu_s:.1f}s), + sync {sync_s:.2f}s",
              flush=True)
        for i, (label, step_src, flags, _) in enumerate(steps):
            out = work / f"out{i}"
            cache.before_step()
            r = run_measured(label, [sk, "reshard", str(step_src), str(out), "--quiet", *flags, *extra], args.poll,
                             work / f"step{i}.log", code.env)
            out_bytes[label] = dir_bytes(out)
            runs[label].append(r)
            print(f"{tag} {label}: {r.wall_s:.2f}s ({r.wall_s / cp_s:.2f}x cp); peak RSS tree "
                  f"{r.peak_tree_rss / MB:.0f} MB (max process {r.peak_max_rss / MB:.0f} MB, {r.peak_procs} procs); "
                  f"CPU {r.cpu_s:.1f}s; wrote {out_bytes[label] / GB:.3f} GB", flush=True)
            shutil.rmtree(out)
        loads.append(uptime())
    cp_s = median([c for c, _ in cps])
    cp_sync_s = median([c + y for c, y in cps])
    cp_cpu_s = median(cp_cpu)
    rows = []
    base_of = {label: base for label, _, _, base in steps}
    for label, rs in runs.items():
        wall = median([r.wall_s for r in rs])
        base = runs.get(base_of[label]) if base_of[label] else None
        vs = (dict(vs_native=base_of[label], vs_native_wall=wall / median([r.wall_s for r in base]),
                   vs_native_cpu=median([r.cpu_s for r in rs]) / median([r.cpu_s for r in base]),
                   vs_native_rss=max(r.peak_tree_rss for r in rs) / max(r.peak_tree_rss for r in base))
              if base else dict(vs_native=None))
        rows.append(dict(step=label, size_gb=src_bytes / GB, cp_s=cp_s, cp_sync_s=cp_sync_s, wall_s=wall, **vs,
                         ratio=wall / cp_s, ratio_sync=wall / cp_sync_s,
                         peak_tree_mb=max(r.peak_tree_rss for r in rs) / MB,
                         peak_max_mb=max(r.peak_max_rss for r in rs) / MB, cpu_s=median([r.cpu_s for r in rs]),
                         cp_cpu_s=cp_cpu_s,
                         out_gb=out_bytes[label] / GB, runs_s=[round(r.wall_s, 2) for r in rs], cmd=" ".join(rs[-1].cmd)))
    cmd = "python scripts/bench_reshard.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = [f"Command: `{cmd}`", f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
          f"Code: {code.root}", f"Cache mode: {cache.describe()}",
          f"Source: native tp1pp1 checkpoint of a synthetic model, {s.describe()}, {src_bytes / GB:.2f} GB",
          "Load (`uptime`, before/after each repeat): " + " | ".join(f"`{u}`" for u in loads), "",
          "| step | size GB | cp s | cp+sync s | step s | ratio vs cp | ratio vs cp+sync | peak RSS tree MB | "
          "peak RSS max-process MB | CPU s | cp CPU s | wrote GB | runs s | vs native: wall / CPU / RSS |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        vs = (f"{r['vs_native_wall']:.2f}x / {r['vs_native_cpu']:.2f}x / {r['vs_native_rss']:.2f}x "
              f"({r['vs_native']})" if r["vs_native"] else "-")
        md.append(f"| {r['step']} | {r['size_gb']:.2f} | {r['cp_s']:.2f} | {r['cp_sync_s']:.2f} | {r['wall_s']:.2f} | "
                  f"{r['ratio']:.2f} | {r['ratio_sync']:.2f} | {r['peak_tree_mb']:.0f} | {r['peak_max_mb']:.0f} | "
                  f"{r['cpu_s']:.1f} | {r['cp_cpu_s']:.1f} | {r['out_gb']:.2f} | {r['runs_s']} | {vs} |")
    md += ["", "```", machine_facts(work), "```"]
    text = "\n".join(md) + "\n"
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "uptime": loads, "cache": cache.mode}, indent=1))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
