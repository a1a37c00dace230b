"""`shardkit launch`: render scripts/torchrun.sh and scripts/sbatch.template for continue-pretrain at a layout.

The layout's model-parallel sizes become Megatron's flags on the continue-pretrain command line; data parallel is
what is left of the world size (the trainer derives it), so it is checked here, not passed.
"""
from __future__ import annotations

import argparse
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from checkpoint.errors import WriteError
from checkpoint.run_layout import RunLayout

from .units import PlanError

TEMPLATES = Path(__file__).resolve().parents[1] / "scripts"
TORCHRUN_TEMPLATE = "torchrun.sh"
SBATCH_TEMPLATE = "sbatch.template"
# flags the layout sets; the same flag after `--` would contradict it
_LAYOUT_FLAGS = {
    "tp": ("--tensor-model-parallel-size", "--tp"),
    "pp": ("--pipeline-model-parallel-size", "--pp"),
    "vpp": ("--virtual-pipeline-model-parallel-size", "--vpp"),
    "cp": ("--context-parallel-size", "--cp"),
    "ep": ("--expert-model-parallel-size", "--ep"),
    "etp": ("--expert-tensor-parallel-size", "--etp"),
}


@dataclass(frozen=True)
class LaunchSpec:
    layout: RunLayout
    nodes: int
    gpus_per_node: int
    args: tuple[str, ...]  # continue-pretrain arguments after `--`
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    job_name: str = "shardkit-pretrain"
    time: str = "24:00:00"
    log_dir: str = "logs"  # SLURM does not create it: write_scripts does
    python: str = sys.executable
    sbatch_extra: tuple[str, ...] = ()  # extra '#SBATCH ...' lines, e.g. --partition=gpu
    env: tuple[str, ...] = ()  # extra KEY=VALUE exports


def check(spec: LaunchSpec) -> None:
    """The layout must use exactly the GPUs asked for, TP inside a node, and not be contradicted after `--`."""
    lay, world = spec.layout, spec.nodes * spec.gpus_per_node
    if spec.nodes < 1 or spec.gpus_per_node < 1:
        raise PlanError(f"--nodes {spec.nodes} and --gpus-per-node {spec.gpus_per_node} must be positive")
    if lay.world != world:
        raise PlanError(f"--layout {lay.label()} uses tp x pp x cp x dp = {lay.world} GPUs but --nodes {spec.nodes} x "
                        f"--gpus-per-node {spec.gpus_per_node} = {world}")
    if lay.tp > spec.gpus_per_node or spec.gpus_per_node % lay.tp:
        raise PlanError(f"--layout: tp {lay.tp} must divide --gpus-per-node {spec.gpus_per_node} (TP stays inside a "
                        "node)")
    for a in spec.args:
        name = a.split("=", 1)[0]
        for flags in _LAYOUT_FLAGS.values():
            if name in flags:
                raise PlanError(f"{name} after `--` contradicts --layout ({lay.label()}); give the layout once, in "
                                "--layout")
    for e in spec.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", e):
            raise PlanError(f"--env {e!r}: expected KEY=VALUE")


class _TrainerParser(argparse.ArgumentParser):
    """continue-pretrain's flags (train.config.add_arguments), parsed at launch time: a refusal is a PlanError in
    the words `shardkit continue-pretrain` would use."""

    def error(self, message: str):
        raise PlanError(f"continue-pretrain arguments after `--`: continue-pretrain: {message} (see shardkit "
                        "continue-pretrain --help)")


def check_trainer_args(spec: LaunchSpec) -> None:
    """Parse the continue-pretrain command line with the trainer's flags now, not when the job starts after hours in
    a queue: a flag the trainer does not know (a layout dimension it does not implement yet, a typo) is an error
    here."""
    from train.config import add_arguments

    check(spec)
    parser = _TrainerParser(prog="shardkit continue-pretrain", add_help=False)
    known = {s for a in add_arguments(parser) for s in a.option_strings}
    args = trainer_args(spec)
    for a in args[:len(args) - len(spec.args)]:
        if a.startswith("--") and a not in known:
            raise PlanError(f"--layout {spec.layout.label()}: continue-pretrain has no {a}; this layout cannot be "
                            "launched with this version of shardkit")
    _check_batch(spec, parser.parse_args(args))


def _check_batch(spec: LaunchSpec, ns: argparse.Namespace) -> None:
    """What the trainer checks first once all ranks are up (train/loop.py), checked before the job is queued:
    the global batch is whole micro-batches on every data-parallel rank, and the --config values are typed."""
    from train.config import from_namespace

    d = from_namespace(ns).data
    dp = spec.layout.dp
    if d.micro_batch_size < 1 or d.global_batch_size < 1:
        raise PlanError(f"continue-pretrain arguments after `--`: --micro-batch-size {d.micro_batch_size} and "
                        f"--global-batch-size {d.global_batch_size} must be >= 1")
    if d.global_batch_size % (d.micro_batch_size * dp):
        raise PlanError(f"--global-batch-size {d.global_batch_size} is not divisible by --micro-batch-size "
                        f"{d.micro_batch_size} x data-parallel size {dp} (--layout {spec.layout.label()}); the "
                        "trainer would refuse it once the job starts")


def trainer_args(spec: LaunchSpec) -> list[str]:
    """continue-pretrain's arguments: the layout as Megatron flags, then the user's."""
    lay = spec.layout
    out = ["--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp)]
    if lay.vpp > 1:
        out += ["--virtual-pipeline-model-parallel-size", str(lay.vpp)]
    if lay.cp > 1:
        out += ["--context-parallel-size", str(lay.cp)]
    if lay.ep > 1:
        out += ["--expert-model-parallel-size", str(lay.ep)]
    if lay.etp is not None and lay.etp != lay.tp:
        out += ["--expert-tensor-parallel-size", str(lay.etp)]
    return out + list(spec.args)


def render(template: str, fields: dict[str, str], name: str) -> str:
    """Replace every {{FIELD}}; a field the template names but we do not fill is an error, not a blank."""
    def sub(m: re.Match) -> str:
        if m.group(1) not in fields:
            raise PlanError(f"{name}: unknown template field {{{{{m.group(1)}}}}}")
        return fields[m.group(1)]
    return re.sub(r"\{\{([A-Z_]+)\}\}", sub, template)


def _read_template(name: str, template_dir: Path) -> str:
    path = template_dir / name
    try:
        return path.read_text()
    except OSError as e:
        raise PlanError(f"{path}: cannot read the launch template ({e.strerror or e})") from None


def render_scripts(spec: LaunchSpec, torchrun_path: str = "torchrun.sh",
                   template_dir: Path = TEMPLATES) -> dict[str, str]:
    """{"torchrun.sh": ..., "job.sbatch": ...}: the rendered launch scripts."""
    check(spec)
    args = trainer_args(spec)
    groups: list[list[str]] = []
    for a in args:  # one flag and its values per line
        if not groups or (a.startswith("-") and not re.fullmatch(r"-[0-9.e+-]+", a)):
            groups.append([])
        groups[-1].append(a)
    lines = ["    " + " ".join(shlex.quote(a) for a in g) for g in groups]
    common = {"LAYOUT": spec.layout.label(), "WORLD": str(spec.layout.world), "NODES": str(spec.nodes),
              "GPUS_PER_NODE": str(spec.gpus_per_node), "MASTER_PORT": str(spec.master_port)}
    torchrun = render(_read_template(TORCHRUN_TEMPLATE, template_dir), {
        **common, "MASTER_ADDR": spec.master_addr, "PYTHON": shlex.quote(spec.python),
        "ENV": "".join(f"export {e.split('=', 1)[0]}={shlex.quote(e.split('=', 1)[1])}\n" for e in spec.env),
        "ARGS": " \\\n".join(lines)}, TORCHRUN_TEMPLATE)
    sbatch = render(_read_template(SBATCH_TEMPLATE, template_dir), {
        **common, "JOB_NAME": spec.job_name, "TIME": spec.time, "LOG_DIR": spec.log_dir,
        "SBATCH_EXTRA": "".join(f"#SBATCH {x}\n" for x in spec.sbatch_extra),
        "TORCHRUN_SCRIPT": shlex.quote(torchrun_path)}, SBATCH_TEMPLATE)
    return {"torchrun.sh": torchrun, "job.sbatch": sbatch}


def write_scripts(spec: LaunchSpec, out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir).resolve()
    scripts = render_scripts(spec, torchrun_path=str(out / "torchrun.sh"))
    paths = {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
        for name, text in scripts.items():
            p = out / name
            p.write_text(text)
            p.chmod(0o755)
            paths[name] = p
    except OSError as e:
        raise WriteError(f"{out}: cannot write the launch scripts ({e.strerror or e})") from None
    return paths
