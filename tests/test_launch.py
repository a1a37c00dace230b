"""`shardkit plan` -> `shardkit launch` -> `continue-pretrain` as one path (issue 37): the layout, pipeline split,
recompute and sequence parallelism plan chose are what launch writes, and the continue-pretrain command line it writes
parses and passes the trainer's own start-up checks against a checkpoint of the model's depth; a layout the trainer
would refuse is refused by launch (one line, non-zero exit, nothing written, --dry-run too); the rendered scripts hold
nothing of the submitting machine and find their Python when they run; the templates are package data."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from checkpoint.run_layout import RunLayout
from plan.launch import LaunchSpec, render_scripts
from plan.search import layout_arg, parse_layout
from shardkit.cli import main
from tests.launch_models import continue_pretrain_args, data, tiny_like, trainer_accepts

REPO = Path(__file__).resolve().parents[1]
# the models of the issue, at the scale plan is asked about: (preset, GPUs, sequence length)
PLANS = {"llama3.1-405b": ("llama3.1-405b", 128, 8192), "llama3-70b": ("llama3-70b", 64, 4096),
         "mixtral-8x7b": ("mixtral-8x7b", 64, 4096)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny checkpoints at the real depths (126, 80, 32 layers; llama3-8b's 32 for the generic cases), and data."""
    root = tmp_path_factory.mktemp("launch-models")
    out = {name: tiny_like(name, root / name) for name in ("llama3.1-405b", "llama3-70b", "mixtral-8x7b",
                                                            "llama3-8b")}
    out["data"] = data(root)
    return out


def _scripts(text: str, out: Path) -> dict[str, str]:
    """launch --dry-run's output -> {"torchrun.sh": ..., "job.sbatch": ...}."""
    parts, name = {}, None
    for line in text.splitlines(keepends=True):
        if line.startswith("# ---- ") and line.rstrip().endswith(" ----"):
            name = Path(line[len("# ---- "):-len(" ----\n")]).name
            parts[name] = ""
        elif name:
            parts[name] += line
    return parts


# -- the path: plan's choice, launched, accepted by the trainer ------------------------------------------------------

@pytest.mark.parametrize("name", list(PLANS))
def test_plan_choice_launches_and_the_trainer_accepts_it(name, models, tmp_path, capsys):
    preset, gpus, seq = PLANS[name]
    assert main(["plan", "--model", preset, "--gpus", str(gpus), "--seq-length", str(seq), "--json", "--top", "1"]) == 0
    plan = json.loads(capsys.readouterr().out)
    chosen = plan["layouts"][0]
    assert chosen["fits"], chosen["reason"]
    argv = plan["launch"]
    assert argv[:2] == ["shardkit", "launch"]
    lay = parse_layout(argv[argv.index("--layout") + 1])
    assert lay.label() == chosen["label"]  # launch gets the layout plan chose, its split included
    out = tmp_path / "launch"
    assert main(["launch", "--out", str(out), *argv[2:], "--load", str(models[name]), "--data-path",
                 str(models["data"]), "--save", str(tmp_path / "save")]) == 0, capsys.readouterr().err
    torchrun = (out / "torchrun.sh").read_text()
    args = continue_pretrain_args(torchrun)
    # what plan chose is on the command line: the layout as Megatron flags, its split, recompute, SP with TP
    assert args[args.index("--tensor-model-parallel-size") + 1] == str(lay.tp)
    assert args[args.index("--pipeline-model-parallel-size") + 1] == str(lay.pp)
    for flag in lay.split.flags() if lay.split else []:
        assert flag in args
    if chosen["recompute"] != "none":
        assert args[args.index("--recompute-granularity") + 1] == chosen["recompute"]
    else:
        assert "--recompute-granularity" not in args
    assert ("--sequence-parallel" in args) == (lay.tp > 1)
    assert args[args.index("--engine") + 1] == chosen["engine"]  # the engine plan modelled (issue 40)
    assert args[args.index("--transformer-impl") + 1] == chosen["transformer_impl"]  # and its layer spec
    # ... and the trainer's own start-up checks accept it at the job's world size, against a checkpoint of that depth
    cfg, dims = trainer_accepts(args, world=gpus)
    assert dims == lay
    assert cfg.run.recompute_granularity == (None if chosen["recompute"] == "none" else chosen["recompute"])
    assert cfg.data.seq_length == seq and cfg.run.bf16 and cfg.parallel.sequence_parallel == (lay.tp > 1)
    assert cfg.run.transformer_impl == chosen["transformer_impl"] == "transformer_engine"


def test_405b_uneven_split_is_carried(models, tmp_path, capsys):
    """The issue's case: 126 layers at PP 8. With plan's split launch writes Megatron's flags and the trainer takes
    them; without one launch refuses (as the trainer would), naming the split plan would use."""
    ck, d = str(models["llama3.1-405b"]), str(models["data"])
    train = ["--", "--load", ck, "--data-path", d, "--seq-length", "8192", "--global-batch-size", "1024",
             "--attention-dropout", "0"]
    assert main(["launch", "--layout", "tp8 pp8 dp2 first15 last15", "--nodes", "16", "--dry-run",
                 "--recompute", "selective", *train]) == 0
    scripts = _scripts(capsys.readouterr().out, tmp_path)
    args = continue_pretrain_args(scripts["torchrun.sh"])
    assert " ".join(args).startswith("--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
                                     "--decoder-first-pipeline-num-layers 15 --decoder-last-pipeline-num-layers 15 "
                                     "--sequence-parallel --recompute-granularity selective")
    _, dims = trainer_accepts(args, world=128)
    assert dims.model_parallel.chunk_layers(126) == (15, 16, 16, 16, 16, 16, 16, 15)
    for dry in (["--dry-run"], []):
        out = tmp_path / f"refused{len(dry)}"
        assert main(["launch", "--layout", "tp=8,pp=8,dp=2", "--nodes", "16", "--out", str(out), *dry, *train]) == 1
        io = capsys.readouterr()
        assert io.out == "" and io.err.count("\n") == 1 and io.err.startswith("shardkit: error: ")
        assert "num_hidden_layers=126 is not divisible by --pp 8" in io.err
        assert "plan's split for it: --layout tp=8,pp=8,dp=2,first=15,last=15" in io.err
        assert not out.exists()


@pytest.mark.parametrize("layout,nodes,extra,needle", [
    ("tp=1,pp=1,ep=16,dp=64", 8, [], "--ep 16 does not divide the number of experts (8)"),
    ("tp=2,pp=4,dp=8", 8, ["--no-sequence-parallel-here"], "unrecognized arguments"),
    ("tp=8,pp=4,dp=2", 8, ["--seq-length", "65536"], "exceeds the model's max_position_embeddings (32768)"),
    ("tp=2,pp=4,cp=2,dp=4", 8, ["--attention-dropout", "0.1"], "--attention-dropout 0.1 with --context-parallel-size"),
    ("tp=2,pp=4,dp=8", 8, ["--global-batch-size", "12"], "--global-batch-size 12 is not divisible"),
    ("tp=2,pp=4,dp=8", 8, ["--num-layers", "30"], "--num-layers 30 disagrees with the checkpoint"),
    ("tp=2,pp=4,dp=8", 8, ["--pipeline-model-parallel-layout", "Et*7|t*8|t*8|t*8L"],
     "31 decoder layers (t), but num_hidden_layers=32"),
])
def test_launch_refuses_what_the_trainer_refuses(layout, nodes, extra, needle, models, tmp_path, capsys):
    """Mixtral 8x7B's depth (32 layers, 8 experts): each job the trainer would refuse at start-up is one line at
    launch, non-zero, nothing written."""
    out = tmp_path / "launch"
    argv = ["launch", "--layout", layout, "--nodes", str(nodes), "--out", str(out), "--",
            "--load", str(models["mixtral-8x7b"]), "--data-path", str(models["data"]), "--global-batch-size", "256",
            *extra]
    assert main(argv) == 1
    io = capsys.readouterr()
    assert io.err.startswith("shardkit: error: ") and io.err.count("\n") == 1 and needle in io.err, io.err
    assert not out.exists()


def test_launch_engine(models, tmp_path, capsys):
    """launch --engine writes continue-pretrain's --engine; a layout with CP > 1 is taken by both engines (each
    sharding the optimizer its own way); --engine twice (before and after `--`) is a contradiction."""
    train = ["--", "--load", str(models["llama3-8b"]), "--data-path", str(models["data"]), "--global-batch-size",
             "256", "--attention-dropout", "0"]
    assert main(["launch", "--layout", "tp=2,pp=4,dp=8", "--nodes", "8", "--engine", "megatron-core", "--dry-run",
                 *train]) == 0
    args = continue_pretrain_args(_scripts(capsys.readouterr().out, tmp_path)["torchrun.sh"])
    assert args[args.index("--engine") + 1] == "megatron-core"
    cp = ["launch", "--layout", "tp=2,pp=4,cp=2,dp=4", "--nodes", "8", "--dry-run"]
    assert main([*cp, "--engine", "megatron-core", *train]) == 0
    assert "engine megatron-core; optimizer state sharded over DP x CP = 8" in capsys.readouterr().out
    assert main([*cp, "--engine", "native", *train]) == 0
    out = capsys.readouterr().out
    assert "engine native; optimizer state sharded over DP = 4" in out
    assert main([*cp, "--engine", "native", *train, "--engine", "native"]) == 1
    assert "contradicts launch's --engine native" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["megatron-core", "native"])
def test_launch_layer_spec(engine, models, tmp_path, capsys):
    """plan's command pins the layer spec it modeled after `--`: launch takes TE's spec as on the GPU nodes plan
    models (Transformer Engine installed there, whether or not it is here) and passes it on; a second
    --transformer-impl with another value (appended to plan's command) is refused in one line, nothing written; the
    same value twice is taken."""
    train = ["--", "--load", str(models["llama3-8b"]), "--data-path", str(models["data"]), "--global-batch-size",
             "256", "--attention-dropout", "0", "--transformer-impl", "transformer_engine"]
    launch = ["launch", "--layout", "tp=2,pp=4,dp=8", "--nodes", "8", "--engine", engine, "--dry-run"]
    assert main([*launch, *train]) == 0, capsys.readouterr().err
    args = continue_pretrain_args(_scripts(capsys.readouterr().out, tmp_path)["torchrun.sh"])
    assert args[args.index("--transformer-impl") + 1] == "transformer_engine"
    cfg, _ = trainer_accepts(args, world=64)
    assert cfg.run.transformer_impl == "transformer_engine"
    assert main([*launch, *train, "--transformer-impl=transformer_engine"]) == 0
    capsys.readouterr()
    out = tmp_path / "refused"
    assert main([*launch[:-1], "--out", str(out), *train, "--transformer-impl", "local"]) == 1
    io = capsys.readouterr()
    assert io.err == ("shardkit: error: --transformer-impl after `--` given twice, as transformer_engine and local: the "
                      "second contradicts the first (plan's command pins the layer spec it modeled); give it once\n")
    assert not out.exists()


def test_launch_skip_load_check(models, tmp_path, capsys):
    """--load not reachable from this machine: refused by default (it is opened to check the layout), written with
    --skip-load-check; the flag checks that need no checkpoint still run."""
    argv = ["launch", "--layout", "tp=2,dp=4", "--nodes", "1", "--dry-run"]
    train = ["--", "--load", "/nowhere/ck", "--data-path", str(models["data"])]
    assert main([*argv, *train]) == 1
    assert "/nowhere/ck" in capsys.readouterr().err
    assert main([*argv, "--skip-load-check", *train]) == 0
    capsys.readouterr()
    assert main([*argv, "--skip-load-check", *train, "--global-batch-size", "6"]) == 1
    assert "--global-batch-size 6 is not divisible" in capsys.readouterr().err


def test_launch_contradictions(models, capsys):
    base = ["launch", "--nodes", "1", "--dry-run"]
    train = ["--load", str(models["llama3-8b"]), "--data-path", str(models["data"])]
    assert main([*base, "--layout", "tp=2,pp=4,first=8,last=8", "--", *train,
                 "--decoder-first-pipeline-num-layers", "8"]) == 1
    assert "--decoder-first-pipeline-num-layers after `--` contradicts --layout" in capsys.readouterr().err
    assert main([*base, "--layout", "tp=2,pp=4", "--recompute", "full", "--", *train,
                 "--recompute-granularity", "selective"]) == 1
    assert "--recompute-granularity after `--` contradicts --recompute full" in capsys.readouterr().err
    # a split given only after `--` is the user's: checked by the trainer's rules all the same
    assert main([*base, "--layout", "tp=2,pp=4", "--", *train, "--decoder-first-pipeline-num-layers", "5",
                 "--decoder-last-pipeline-num-layers", "6"]) == 1
    assert "the 21 layers left for the 2 middle stages" in capsys.readouterr().err
    assert main([*base, "--layout", "tp=2,pp=4", "--", *train, "--decoder-first-pipeline-num-layers", "8",
                 "--decoder-last-pipeline-num-layers", "8"]) == 0


def test_layout_syntax():
    for text in ("tp=8,pp=8,dp=16,first=15,last=15", "tp8 pp8 dp16 first15 last15", "tp=8 pp8,dp=16 first=15,last15"):
        lay = parse_layout(text)
        assert lay.label() == "tp8 pp8 dp16 first15 last15" and layout_arg(lay) == "tp=8,pp=8,dp=16,first=15,last=15"
    lay = parse_layout("tp=2,pp=4,vpp=2,dp=1 layout=Et*3|(tt|)*6,tL")
    assert lay.split.layout == "Et*3|(tt|)*6,tL" and parse_layout(layout_arg(lay)) == lay
    assert parse_layout("tp4 pp2 dp2 embedding-in-split").split.embedding
    assert parse_layout(layout_arg(RunLayout(tp=4, ep=8, etp=1, dp=2))) == RunLayout(tp=4, ep=8, etp=1, dp=2)


# -- the scripts: nothing of this machine; the interpreter found when the job runs -----------------------------------

def test_rendered_scripts_hold_no_machine_path(models, tmp_path, capsys):
    out = tmp_path / "launch"
    assert main(["launch", "--layout", "tp=2,pp=2,dp=2", "--nodes", "1", "--out", str(out), "--", "--load",
                 str(models["llama3-8b"]), "--data-path", str(models["data"]), "--save", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    for name in ("torchrun.sh", "job.sbatch"):
        text = (out / name).read_text()
        for machine in {sys.executable, os.path.realpath(sys.executable), sys.prefix, str(REPO)}:
            assert machine not in text, (name, machine)
    torchrun = out / "torchrun.sh"
    # a fake interpreter stands in for the job's python: it is found at run time and gets the trainer's arguments
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text('#!/usr/bin/env bash\n[[ $1 == -c ]] && exit 0\necho "RAN $*"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{fake.parent}:/usr/bin:/bin", "SHARDKIT_LAUNCHER": "srun", "HOME": str(tmp_path)}
    r = subprocess.run(["bash", str(torchrun)], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("RAN -m shardkit continue-pretrain --tensor-model-parallel-size 2")
    r = subprocess.run(["bash", str(torchrun)], env={**env, "SHARDKIT_PYTHON": "/bin/false"}, capture_output=True,
                       text=True)
    assert r.returncode == 2 and "/bin/false cannot import shardkit and torch" in r.stderr
    assert "SHARDKIT_PYTHON" in r.stderr
    r = subprocess.run(["bash", str(torchrun)], env={**env, "SHARDKIT_LAUNCHER": "torchrun"}, capture_output=True,
                       text=True)
    assert r.stdout.startswith("RAN -m shardkit.torchrun --nnodes 1 --nproc-per-node 8")


def test_templates_are_package_data():
    from importlib import resources

    import tomllib

    assert "{{ARGS}}" in (resources.files("plan") / "templates" / "torchrun.sh").read_text()
    assert "{{TORCHRUN_SCRIPT}}" in (resources.files("plan") / "templates" / "sbatch.template").read_text()
    pkg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "templates/*" in pkg["plan"]


# -- flags and rendering (were in test_plan.py) ----------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["launch", "--layout", "tp=4,pp=4,dp=4", "--nodes", "1", "--dry-run"], "uses tp x pp x cp x dp = 64 GPUs"),
    (["launch", "--layout", "tp=8,dp=2", "--nodes", "4", "--gpus-per-node", "4", "--dry-run"], "must divide"),
    (["launch", "--layout", "tp=2,dp=4", "--nodes", "1", "--dry-run", "--", "--tp", "4"], "contradicts --layout"),
    (["launch", "--layout", "tp=2,dp=4,first=x", "--nodes", "1", "--dry-run"], "--layout: cannot parse 'first=x'"),
])
def test_bad_input(argv, needle, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardkit: error: ") and needle in err and err.count("\n") == 1


def test_launch_dry_run(models, capsys, tmp_path):
    out = tmp_path / "run"
    ck, d = str(models["llama3-8b"]), str(models["data"])
    assert main(["launch", "--layout", "tp=4,pp=2,vpp=2,dp=4", "--nodes", "4", "--gpus-per-node", "8", "--slurm",
                 "--dry-run", "--out", str(out), "--partition", "gpu", "--account", "llm", "--",
                 "--load", ck, "--save", str(tmp_path / "run 1"), "--data", d, d,
                 "--micro-batch-size", "1", "--global-batch-size", "512", "--seq-length", "8192"]) == 0
    text = capsys.readouterr().out
    sbatch, torchrun = text.split(f"# ---- {out / 'torchrun.sh'} ----\n")
    assert sbatch.startswith(f"# ---- {out / 'job.sbatch'} ----")
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=gpu", "#SBATCH --account=llm",
                 f"srun --kill-on-bad-exit=1 bash {out / 'torchrun.sh'}"):
        assert line in sbatch
    assert "NNODES=${NNODES:-4}" in torchrun and "GPUS_PER_NODE=${GPUS_PER_NODE:-8}" in torchrun
    assert "-m shardkit continue-pretrain" in torchrun
    joined = " ".join(torchrun.replace("\\\n", " ").split())
    assert ("--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
            f"--sequence-parallel --exit-signal-handler --exit-signal SIGUSR1 --load {ck} --save "
            f"'{tmp_path / 'run 1'}' --data {d} {d}") in joined
    assert "{{" not in text
    assert f"    --data {d} {d} \\\n" in torchrun  # one flag and its values per line
    assert f"#SBATCH --output={out / 'logs'}/%x-%j.out" in sbatch
    assert "recompute as given below; sequence parallel; optimizer state sharded over DP x CP = 4" in torchrun
    assert not out.exists()  # dry run writes nothing


def test_launch_writes_valid_shell(models, tmp_path, capsys):
    assert main(["launch", "--layout", "tp=2,pp=2,dp=2", "--nodes", "1", "--out", str(tmp_path), "--env",
                 "NCCL_SOCKET_IFNAME=eth0", "--", "--load", str(models["llama3-8b"]), "--save",
                 str(tmp_path / "out"), "--data", str(models["data"])]) == 0
    for name in ("torchrun.sh", "job.sbatch"):
        p = tmp_path / name
        assert p.stat().st_mode & 0o111
        subprocess.run(["bash", "-n", str(p)], check=True)  # syntax only
    assert "export NCCL_SOCKET_IFNAME=eth0" in (tmp_path / "torchrun.sh").read_text()
    assert (tmp_path / "logs").is_dir()
    scripts = render_scripts(LaunchSpec(RunLayout(tp=4, cp=2, ep=8, etp=1, dp=1), 1, 8, ("--save", "x")))
    assert ("--context-parallel-size 2 \\\n    --expert-model-parallel-size 8 \\\n    --expert-tensor-parallel-size 1"
            in scripts["torchrun.sh"])


def test_launch_checks_the_trainer_flags_before_queueing(models, capsys):
    """The continue-pretrain arguments go through the trainer's own parser at launch time: a typo fails now and not
    hours later in the queue."""
    train = ["--load", str(models["llama3-8b"]), "--data", str(models["data"])]
    assert main(["launch", "--layout", "tp=2,pp=2,dp=2", "--nodes", "1", "--dry-run", "--", *train,
                 "--lr-warmup-itres", "10"]) == 1
    assert "unrecognized arguments: --lr-warmup-itres 10" in capsys.readouterr().err
    assert main(["launch", "--layout", "tp=2,cp=2,dp=2", "--nodes", "1", "--dry-run", "--", *train,
                 "--attention-dropout", "0"]) == 0


# -- from an installed package ----------------------------------------------------------------------------------------

def test_launch_from_a_wheel_install(models, tmp_path, capsys):
    """shardkit built as a wheel and installed (--no-deps) into a fresh venv that borrows this one's dependencies
    (torch, transformers, ...), run from outside the repository: launch reads its templates from the installed
    package, renders plan's choice for Llama-3.1-405B, and the command line it writes passes the trainer's checks."""
    import shutil

    src = tmp_path / "src"  # a copy: setuptools builds in the source tree (build/, *.egg-info)
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    import tomllib

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    for pkg in sorted({p.split(".")[0] for p in packages}):  # the top-level packages the wheel is built from
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    quiet = dict(check=True, capture_output=True, text=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w",
                    str(tmp_path / "dist")], cwd=tmp_path, **quiet)
    wheel = next((tmp_path / "dist").glob("shardkit-*.whl"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], **quiet)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               **quiet).stdout.strip())
    deps = Path(subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               **quiet).stdout.strip())
    # this venv's packages as a plain path entry: its .pth files (the editable shardkit's finder) are not run
    (site / "borrowed-deps.pth").write_text(f"{deps}\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   **quiet)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONWARNINGS"] = "ignore"
    where = subprocess.run([py, "-c", "import plan.launch, shardkit; print(plan.launch.__file__)"], cwd=tmp_path,
                           env=env, **quiet).stdout.strip()
    assert where.startswith(str(site)), where  # the installed package, not the repository
    preset, gpus, seq = PLANS["llama3.1-405b"]
    r = subprocess.run([venv / "bin" / "shardkit", "plan", "--model", preset, "--gpus", str(gpus), "--seq-length",
                        str(seq), "--json", "--top", "1"], cwd=tmp_path, env=env, **quiet)
    argv = json.loads(r.stdout)["launch"]
    out = tmp_path / "launch"
    r = subprocess.run([venv / "bin" / "shardkit", "launch", "--out", str(out), *argv[2:], "--load",
                        str(models["llama3.1-405b"]), "--data-path", str(models["data"]), "--save",
                        str(tmp_path / "save")], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    torchrun = (out / "torchrun.sh").read_text()
    for machine in (str(venv), str(REPO), sys.executable):
        assert machine not in torchrun and machine not in (out / "job.sbatch").read_text()
    lay = parse_layout(argv[argv.index("--layout") + 1])
    _, dims = trainer_accepts(continue_pretrain_args(torchrun), world=gpus)
    assert dims == lay


def test_inspect_shows_the_uneven_split(models, tmp_path, capsys):
    """inspect's text (not only --json) names an uneven split and each stage's decoder layers; piped or captured it is
    not wrapped at 80 columns: one line per tensor."""
    ck = tmp_path / "pp8"
    assert main(["reshard", str(models["llama3.1-405b"]), str(ck), "--pp", "8", "--decoder-first-pipeline-num-layers",
                 "15", "--decoder-last-pipeline-num-layers", "15", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(ck)]) == 0
    out = capsys.readouterr().out
    assert ("layout: tp=1 pp=8 vpp=1  pipeline split: --decoder-first-pipeline-num-layers 15 "
            "--decoder-last-pipeline-num-layers 15 (decoder layers per stage: 15 | 16 | 16 | 16 | 16 | 16 | 16 | 15)"
            in out)
    rows = [line for line in out.splitlines() if "decoder.layers.self_attention.linear_qkv.weight" in line]
    assert len(rows) == 1 and "(126, " in rows[0] and len(rows[0]) > 80  # shape, dtype, chunk on the tensor's line


def test_moe_tp_ep_message_names_etp(models, capsys):
    """Mixtral at --tp 2 --ep 2 on 2 ranks: the fix is --expert-tensor-parallel-size 1 (EP over the TP ranks), and the
    refusal says so instead of "use more ranks or a smaller --ep"; with it the trainer's checks pass."""
    argv = ["launch", "--nodes", "1", "--gpus-per-node", "2", "--dry-run"]
    train = ["--", "--load", str(models["mixtral-8x7b"]), "--data-path", str(models["data"])]
    assert main([*argv, "--layout", "tp=2,ep=2,dp=1", *train]) == 1
    err = capsys.readouterr().err
    assert "add --expert-tensor-parallel-size 1 to lay EP over all tp x cp x dp = 2 ranks" in err
    assert "smaller --ep" not in err and err.count("\n") == 1
    assert main([*argv, "--layout", "tp=2,ep=2,etp=1,dp=1", *train]) == 0
