"""Byte identity of a refactor: run a fixed set of conversions (hf-to-mcore native and torch_dist, reshard,
mcore-to-hf; Llama tp2pp2 and vpp, Mixtral ep2tp2, DeepSeek-V3 ep2) and eight 3-step training runs (TP+SP, PP, VPP,
full recompute, EP, CP, MoE/MLA) with the tree it is run in, and write a digest of every output file, every saved
tensor and every loss. Run it on the commit before a change and on the change, then compare:

    .venv/bin/python scripts/bytecheck.py before.json        (in a checkout of the commit before)
    .venv/bin/python scripts/bytecheck.py after.json
    .venv/bin/python scripts/bytecheck.py --diff before.json after.json     (exit 1 when anything differs)

Volatile fields (dates, hosts, versions, paths) are left out of JSON files; DCP `.metadata` is compared by content.
Run from the repo root."""
import hashlib, json, os, subprocess, sys, tempfile, shutil
from pathlib import Path

if __name__ == "__main__" and sys.argv[1] == "--diff":
    a, b = (json.loads(Path(p).read_text()) for p in sys.argv[2:4])
    bad = 0
    for k in sorted(set(a) | set(b)):
        if a.get(k) != b.get(k):
            bad += 1
            if bad <= 40:
                print("DIFF", k, str(a.get(k))[:80], "|", str(b.get(k))[:80])
    print(f"{bad} differences over {len(set(a) | set(b))} entries")
    sys.exit(1 if bad else 0)

sys.path.insert(0, os.getcwd())
import torch
from shardkit.cli import main as cli
from shardkit.demo import build_tiny_llama
from tests import moe_models
from tests.corpus import write_pattern_corpus
from checkpoint.reader import Checkpoint

# the tree's converter proves its output by default; an older tree's knows no --no-verify (and does not verify)
NO_VERIFY = ["--no-verify"] if "BooleanOptionalAction, default=None" in Path("shardkit/cli.py").read_text() else []

VOLATILE = ("created", "time", "date", "host", "pid", "user", "uuid", "wall", "elapsed", "started", "finished", "version", "seconds", "digest")

def norm_json(obj):
    if isinstance(obj, dict):
        return {k: norm_json(v) for k, v in obj.items() if not any(w in k.lower() for w in VOLATILE)}
    if isinstance(obj, list):
        return [norm_json(v) for v in obj]
    return obj

def digest_tree(root: Path, tag: str, out: dict):
    for f in sorted(root.rglob("*")):
        if not f.is_file() or f.name in ("metrics.jsonl", "run.log") or f.suffix == ".log":
            continue
        rel = f"{tag}/{f.relative_to(root)}"
        data = f.read_bytes()
        if f.name == ".metadata":  # DCP metadata: a pickle holding a path and random save/load ids
            from torch.distributed.checkpoint import FileSystemReader
            md = FileSystemReader(str(f.parent)).read_metadata()
            data = repr((md.state_dict_metadata, md.storage_data, md.planner_data, md.version)).encode()
        if f.suffix == ".json":
            try:
                data = json.dumps(norm_json(json.loads(data)), sort_keys=True).replace(str(WORK), "<W>").encode()
            except Exception:
                pass
        out[rel] = hashlib.sha256(data).hexdigest()[:16]

def digest_ckpt(path: Path, tag: str, out: dict):
    ck = Checkpoint(path if (path / "latest").exists() is False else path)
    for name, t in sorted(ck.state_dict().items()):
        out[f"{tag}:tensor:{name}"] = hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]

def run(argv):
    rc = cli(argv + ["--quiet"]) if argv[0] in ("convert", "reshard") else cli(argv)
    assert rc == 0, argv

def train(nproc, *args):
    py = sys.executable
    if nproc == 1:
        cmd = [py, "-m", "shardkit", "continue-pretrain", *args]
    else:
        import socket
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        cmd = [str(Path(py).parent / "torchrun"), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
               "--master-port", str(port), "-m", "shardkit", "continue-pretrain", *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    assert r.returncode == 0, r.stderr[-3000:]

def main():
    outp = Path(sys.argv[1]); quick = "--quick" in sys.argv
    global WORK
    w = WORK = Path(tempfile.mkdtemp(prefix="bytecheck-"))
    res = {}
    try:
        build_tiny_llama(w / "llama", dtype=torch.float32)
        moe_models.build("mixtral", w / "mixtral")
        moe_models.build("deepseek_v3", w / "dsv3")
        for tag, src, lay in (("llama_tp2pp2", "llama", ["--tp", "2", "--pp", "2"]),
                              ("llama_tp1pp2vpp2", "llama", ["--pp", "2", "--vpp", "2"]),
                              ("mixtral_ep2tp2", "mixtral", ["--ep", "2", "--tp", "2"]),
                              ("dsv3_ep2pp2", "dsv3", ["--ep", "2", "--pp", "1"])):
            run(["convert", "hf-to-mcore", str(w / src), str(w / tag), *lay, *NO_VERIFY])
            digest_tree(w / tag, tag, res)
            run(["convert", "hf-to-mcore", str(w / src), str(w / (tag + "_td")), *lay, "--format", "torch_dist",
                 *NO_VERIFY])
            digest_tree(w / (tag + "_td"), tag + "_td", res)
            run(["reshard", str(w / tag), str(w / (tag + "_r")), "--tp", "1", "--pp", "1", "--vpp", "1", "--ep", "1"])
            digest_tree(w / (tag + "_r"), tag + "_r", res)
            run(["convert", "mcore-to-hf", str(w / tag), str(w / (tag + "_hf"))])
            digest_tree(w / (tag + "_hf"), tag + "_hf", res)
        write_pattern_corpus(w / "data")
        common = ["--seq-length", "32", "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-3",
                  "--lr-warmup-iters", "1", "--min-lr", "1e-4", "--clip-grad", "1.0", "--seed", "7", "--train-iters", "3",
                  "--attention-dropout", "0", "--hidden-dropout", "0"]
        runs = [(1, "t_llama1", "llama_tp2pp2_r", []),
                (2, "t_llama_tp2sp", "llama_tp2pp2_r", ["--tp", "2", "--sequence-parallel"]),
                (2, "t_llama_pp2", "llama_tp2pp2_r", ["--pp", "2"]),
                (2, "t_llama_pp2vpp2", "llama_tp2pp2_r", ["--pp", "2", "--vpp", "2", "--global-batch-size", "4"]),
                (1, "t_llama_full", "llama_tp2pp2_r", ["--recompute-granularity", "full"]),
                (2, "t_mixtral_ep2", "mixtral_ep2tp2_r", ["--ep", "2"]),
                (1, "t_dsv3", "dsv3_ep2pp2_r", []),
                (2, "t_llama_cp2", "llama_tp2pp2_r", ["--cp", "2"])]
        if quick:
            runs = runs[:3]
        for n, tag, src, extra in runs:
            train(n, "--load", str(w / src), "--data-path", str(w / "data"), "--save", str(w / tag), *common, *extra)
            res[f"{tag}:losses"] = [json.loads(l)["loss"] for l in (w / tag / "metrics.jsonl").read_text().splitlines()]
            digest_ckpt(w / tag, tag, res)
    finally:
        shutil.rmtree(w, ignore_errors=True)
    outp.write_text(json.dumps(res, indent=0, sort_keys=True))
    print(f"wrote {outp}: {len(res)} entries")

if __name__ == "__main__":
    main()
