"""`shardkit launch`: render the torchrun and sbatch templates (package data: plan/templates/) for continue-pretrain
at a layout, after the trainer's own start-up checks.

The layout's model-parallel sizes, its pipeline split, sequence parallelism (with TP, as `plan` assumes) and the
recompute `plan` chose become Megatron's flags on the continue-pretrain command line; data parallel is what is left
of the world size (the trainer derives it), so it is checked here, not passed. Before anything is written the whole
command line goes through what `shardkit continue-pretrain` runs at start-up (train/config.py validate, train/loop.py
run_layout at the job's world size, open_load and check_layout_for_model against the --load checkpoint): a job the
trainer would refuse is refused here, in its words, as on the job's GPU nodes with Transformer Engine (the cluster
`plan` models, whose command pins the layer spec it modeled: --transformer-impl after `--`, refused when given twice
with two values); this machine need not have TE. The rendered scripts hold nothing of this machine: the Python that
runs the trainer is found when the job runs (SHARDKIT_PYTHON, else python3 on PATH).
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import shlex
import stat
import tempfile
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from checkpoint.errors import ShardkitError, WriteError
from checkpoint.run_layout import RunLayout
from checkpoint.safety import check_target, read_input

from .units import PlanError

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
# the pipeline split's flags: after `--` they contradict a --layout that gives a split
_SPLIT_FLAGS = ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers",
                "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                "--pipeline-model-parallel-layout")
RECOMPUTE = ("none", "selective", "full")


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
    sbatch_extra: tuple[str, ...] = ()  # extra '#SBATCH ...' lines (options launch has no flag for)
    env: tuple[str, ...] = ()  # extra KEY=VALUE exports
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    exclusive: bool = True
    requeue: bool = False  # '#SBATCH --requeue'; the job resumes from the newest complete checkpoint in --save
    signal: str | None = "USR1@300"  # SLURM's --signal=SIG@SECONDS before the time limit; the trainer saves and exits
    recompute: str | None = None  # plan's choice: none | selective | full (--recompute-granularity); None: as given
    check_load: bool = True  # open --load here and check the layout against its model (launch --skip-load-check)
    engine: str | None = None  # plan's engine: megatron-core | native (--engine); None: as given after `--`


# SLURM's --time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (and no limit)
_TIME = re.compile(r"(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<h>\d+):(?P<m>\d+):(?P<s>\d+)|(?P<mm>\d+):(?P<ss>\d+)|(?P<min>\d+))")
_NO_LIMIT = ("infinite", "unlimited")
# partition / account / QOS names as sbatch takes them (a comma-separated list for --partition)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# options that have a launch flag (or that launch derives from the layout): not again through --sbatch
_MANAGED = {"--partition": "--partition", "-p": "--partition", "--account": "--account", "-A": "--account",
            "--qos": "--qos", "-q": "--qos", "--time": "--time", "-t": "--time", "--nodes": "--nodes",
            "-N": "--nodes", "--gpus-per-node": "--gpus-per-node", "--exclusive": "--exclusive",
            "--requeue": "--requeue", "--no-requeue": "--requeue", "--signal": "--signal", "--job-name": "--job-name",
            "-J": "--job-name", "--ntasks": "--layout", "-n": "--layout", "--ntasks-per-node": "--layout",
            "--gpus": "--gpus-per-node", "-G": "--gpus-per-node", "--output": "--out", "-o": "--out"}


def time_seconds(value: str) -> int | None:
    """SLURM's --time in seconds (None: no limit); a PlanError naming --time for a format sbatch would refuse."""
    v = value.strip()
    if v.lower() in _NO_LIMIT:
        return None
    m = _TIME.fullmatch(v)
    if not m:
        raise PlanError(f"--time {value!r}: not a SLURM time limit; use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                        "D-HH:MM:SS (e.g. 30, 4:00:00, 2-00:00:00)")
    g = {k: int(x) for k, x in m.groupdict().items() if x is not None}
    if "min" in g:
        return g["min"] * 60
    if "mm" in g:
        return g["mm"] * 60 + g["ss"]
    if "h" in g:
        return g["h"] * 3600 + g["m"] * 60 + g["s"]
    return g["d"] * 86400 + g["dh"] * 3600 + g.get("dm", 0) * 60 + g.get("ds", 0)


def parse_signal(value: str | None) -> tuple[str, int] | None:
    """--signal USR1@300 -> ("SIGUSR1", 300); none/off -> None."""
    import signal as _signal

    if value is None or value.lower() in ("none", "off", "no"):
        return None
    m = re.fullmatch(r"(?:SIG)?([A-Za-z0-9]+)@(\d+)", value.strip())
    name = f"SIG{m.group(1).upper()}" if m else ""
    if not m or name not in _signal.Signals.__members__:
        raise PlanError(f"--signal {value!r}: expected SIGNAL@SECONDS before the time limit, e.g. USR1@300 (or none)")
    secs = int(m.group(2))
    if not 0 < secs <= 65535:
        raise PlanError(f"--signal {value!r}: SLURM takes 1 to 65535 seconds before the time limit, got {secs}")
    return name, secs


# a host for torchrun's --master-addr: a DNS name, an IPv4 or an IPv6 address (nothing a shell would expand)
_HOST = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.-]{0,251}[A-Za-z0-9])?|\[?[0-9A-Fa-f:.]{2,45}\]?")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_text(value: str, flag: str) -> None:
    """A value rendered into a script line: a newline or another control character would start a new shell or
    #SBATCH line there (an injected command), so it is refused, naming the flag."""
    m = _CONTROL.search(str(value))
    if m:
        raise PlanError(f"{flag} {value!r}: holds a control character ({m.group()!r}); a launch script line cannot "
                        "carry it")


def check(spec: LaunchSpec) -> None:
    """The layout must use exactly the GPUs asked for, TP inside a node, and not be contradicted after `--`; every
    value rendered into the scripts is one line, and the rank-0 address and port are what torchrun takes."""
    if not _HOST.fullmatch(spec.master_addr):
        raise PlanError(f"--master-addr {spec.master_addr!r}: not a host name or IP address (letters, digits, '.', "
                        "'-', '_', ':' only)")
    if not 1 <= spec.master_port <= 65535:
        raise PlanError(f"--master-port {spec.master_port}: a TCP port is 1 to 65535")
    for flag, v in (("--out", spec.log_dir.removesuffix("/logs")), ("--time", spec.time), ("--job-name", spec.job_name),
                    ("--signal", spec.signal or ""), *(("--sbatch", x) for x in spec.sbatch_extra),
                    *(("--env", e) for e in spec.env), *(("after `--`", a) for a in spec.args)):
        check_text(v, flag)
    lay, world = spec.layout, spec.nodes * spec.gpus_per_node
    if spec.nodes < 1 or spec.gpus_per_node < 1:
        raise PlanError(f"--nodes {spec.nodes} and --gpus-per-node {spec.gpus_per_node} must be positive")
    if lay.world > world:
        raise PlanError(f"--layout {lay.label()} uses tp x pp x cp x dp = {lay.world} GPUs, one SLURM task each, more "
                        f"than --nodes {spec.nodes} x --gpus-per-node {spec.gpus_per_node} = {world}")
    if lay.world != world:
        raise PlanError(f"--layout {lay.label()} uses tp x pp x cp x dp = {lay.world} GPUs but --nodes {spec.nodes} x "
                        f"--gpus-per-node {spec.gpus_per_node} = {world}")
    if lay.tp > spec.gpus_per_node or spec.gpus_per_node % lay.tp:
        raise PlanError(f"--layout: tp {lay.tp} must divide --gpus-per-node {spec.gpus_per_node} (TP stays inside a "
                        "node)")
    if spec.recompute is not None and spec.recompute not in RECOMPUTE:
        raise PlanError(f"--recompute {spec.recompute!r}: expected one of {', '.join(RECOMPUTE)}")
    for a in spec.args:
        name = a.split("=", 1)[0]
        for flags in _LAYOUT_FLAGS.values():
            if name in flags:
                raise PlanError(f"{name} after `--` contradicts --layout ({lay.label()}); give the layout once, in "
                                "--layout")
        if lay.split is not None and name in _SPLIT_FLAGS:
            raise PlanError(f"{name} after `--` contradicts --layout ({lay.label()}), which gives the pipeline "
                            "split; give it once, in --layout")
        if spec.recompute is not None and name in ("--recompute-granularity", "--recompute-activations"):
            raise PlanError(f"{name} after `--` contradicts --recompute {spec.recompute}; give it once")
        if spec.engine is not None and name == "--engine":
            raise PlanError(f"--engine after `--` contradicts launch's --engine {spec.engine}; give it once")
    impls = dict.fromkeys(v for i, a in enumerate(spec.args) for v in
                          ([spec.args[i + 1]] if a == "--transformer-impl" and i + 1 < len(spec.args) else
                           [a.split("=", 1)[1]] if a.startswith("--transformer-impl=") else []))
    if len(impls) > 1:  # plan's command pins the layer spec it modeled; another one after it would win silently
        raise PlanError(f"--transformer-impl after `--` given twice, as {' and '.join(impls)}: the second contradicts "
                        "the first (plan's command pins the layer spec it modeled); give it once")
    for e in spec.env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", e):
            raise PlanError(f"--env {e!r}: expected KEY=VALUE")
    check_slurm(spec)


def check_slurm(spec: LaunchSpec) -> None:
    """The #SBATCH values sbatch would refuse (or take wrongly), refused before anything is submitted."""
    limit = time_seconds(spec.time)
    for flag, v in (("--partition", spec.partition), ("--account", spec.account), ("--qos", spec.qos)):
        if v is None:
            continue
        names = v.split(",") if flag == "--partition" else [v]
        if not all(_NAME.fullmatch(n) for n in names):
            raise PlanError(f"{flag} {v!r}: not a SLURM {flag[2:]} name (letters, digits, '_', '.', '-'"
                            f"{'; several separated by commas' if flag == '--partition' else ''})")
    if not _NAME.fullmatch(spec.job_name):
        raise PlanError(f"--job-name {spec.job_name!r}: use letters, digits, '_', '.', '-'")
    sig = parse_signal(spec.signal)
    if sig and limit is not None and sig[1] >= limit:
        raise PlanError(f"--signal {spec.signal}: {sig[1]} s before the end is not inside --time {spec.time} "
                        f"({limit} s); lower the lead or raise --time")
    for x in spec.sbatch_extra:
        opt = x.split("=", 1)[0].split()[0] if x.strip() else x
        if not opt.startswith("-"):
            raise PlanError(f"--sbatch {x!r}: expected an sbatch option, e.g. --sbatch constraint=h100")
        if opt in _MANAGED:
            raise PlanError(f"--sbatch {x}: launch writes {opt} itself; use {_MANAGED[opt]}")


class _TrainerParser(argparse.ArgumentParser):
    """continue-pretrain's flags (train.config.add_arguments), parsed at launch time: a refusal is a PlanError in
    the words `shardkit continue-pretrain` would use."""

    def error(self, message: str):
        raise PlanError(f"continue-pretrain arguments after `--`: continue-pretrain: {message} (see shardkit "
                        "continue-pretrain --help)")


def _trainer_parser() -> tuple[_TrainerParser, set[str]]:
    from train.config import add_arguments

    parser = _TrainerParser(prog="shardkit continue-pretrain", add_help=False)
    return parser, {s for a in add_arguments(parser) for s in a.option_strings}


def check_trainer_args(spec: LaunchSpec):
    """What `shardkit continue-pretrain` checks at start-up, run now on the command line launch would write, not
    when the job starts after hours in a queue: the trainer's parser (a typo, a layout dimension it does not
    implement), its value and flag checks (train/config.py validate, train/flagcheck.py), the layout at the job's
    world size (train/loop.py run_layout: the global batch over DP, the expert grid), --save against --load, and,
    with `check_load`, the layout against the model of --load (open_load, check_layout_for_model: heads, KV groups,
    ffn and experts over TP/EP, the pipeline split against its layers, sequence parallelism). Every refusal is the
    trainer's own line, with what to do. Returns the trainer's configuration."""
    check(spec)
    parser, known = _trainer_parser()
    args = trainer_args(spec)
    for a in args[:len(args) - len(spec.args)]:
        if a.startswith("--") and a not in known:
            raise PlanError(f"--layout {spec.layout.label()}: continue-pretrain has no {a}; this layout cannot be "
                            "launched with this version of shardkit")
    ns = parser.parse_args(args)
    sig = parse_signal(spec.signal)
    if sig and ns.exit_signal is not None and ns.exit_signal != sig[0]:
        raise PlanError(f"--exit-signal {ns.exit_signal} after `--` is not --signal {spec.signal}'s {sig[0]}: the "
                        "trainer would not catch what SLURM sends; give the signal once, in --signal")
    try:
        cfg = _trainer_checks(spec, ns)
    except PlanError:
        raise
    except ShardkitError as e:
        raise PlanError(f"{e}{_split_hint(spec, e)} (continue-pretrain would refuse this job at start-up; nothing "
                        "written)") from None
    if spec.requeue:
        _resume_paths(spec)
    return cfg


def _trainer_checks(spec: LaunchSpec, ns: argparse.Namespace):
    """The start-up of `shardkit continue-pretrain` (shardkit/cli.py) and of the trainer (train/loop.py Trainer)
    up to building the model, without a process group: the same functions, in the same order."""
    from train.flagcheck import check_train_outputs, check_train_values
    from train.config import from_namespace, validate
    from train.loop import check_layout_for_model, check_save_format, open_load, run_layout

    if getattr(ns, "config", None):  # read next: a FIFO there would block it forever
        from checkpoint.safety import regular_file

        regular_file(ns.config, "--config", missing_ok=True)
    cfg = from_namespace(ns)
    from checkpoint.storage import launch_view

    cfg = launch_view(cfg, spec.check_load)  # s3:// / gs:// --load / --save: passed through, never stat'ed here
    check_train_values(cfg)
    check_train_outputs(cfg)
    validate(cfg, te_on_nodes=True)  # the GPU nodes plan models have Transformer Engine; this machine need not
    dims = run_layout(cfg, world=spec.layout.world)
    mcore = cfg.run.engine == "megatron-core"  # asked for by name: what that engine refuses on the cluster's GPUs
    if mcore:
        from train.engines.megatron_core.checks import NotCovered, check_flags

        try:
            check_flags(cfg, on_cpu=False, have_te=True)
            micro = cfg.data.global_batch_size // (cfg.data.micro_batch_size * dims.dp)
            if dims.vpp > 1 and micro % dims.pp:  # as MegatronCoreTrainer: its interleaved groups of PP micro-batches
                raise NotCovered(f"--vpp {dims.vpp}: megatron-core's interleaved schedule runs the micro-batches in "
                                 f"groups of --pp {dims.pp}, but each DP rank has {micro} per step; make it a "
                                 f"multiple of {dims.pp}")
        except NotCovered as e:
            raise e.as_config_error() from None
    if spec.check_load:
        c = cfg.checkpoint  # the model config is what is checked here; the trainer verifies the chunks when it starts
        ck, src, _, _ = open_load(replace(c, skip_verify=True), cfg.data.global_batch_size)
        if mcore:
            from train.engines.coverage import model_not_covered

            why = model_not_covered(ck.config)
            if why:
                from checkpoint.errors import ConfigError

                raise ConfigError(f"--engine megatron-core: {why}")
            from train.engines.megatron_core.checks import check_context_parallel
            from train.parallel.context import packing_from

            try:  # what it refuses under CP whatever the nodes have (with or without Transformer Engine)
                check_context_parallel(ck.config, packing_from(cfg.data, ck.config, ck.hf_dir()), dims.cp,
                                       te_attention=False, recompute=None)
            except NotCovered as e:
                raise e.as_config_error() from None
        check_layout_for_model(cfg, dims, ck.config, src)
    check_save_format(cfg.checkpoint.save, cfg.checkpoint.save_format)
    return cfg


def _split_hint(spec: LaunchSpec, e: Exception) -> str:
    """A layout without a split whose stages do not divide the layers: the split `plan` picks for it, as --layout."""
    lay = spec.layout
    m = re.search(r"num_hidden_layers=(\d+) is not divisible by --pp", str(e))
    if m is None or lay.split is not None or lay.pp < 2:
        return ""
    from .search import layout_arg, uneven_split

    split = uneven_split(int(m.group(1)), lay.pp, lay.vpp)
    if split is None:
        return ""
    return f"; plan's split for it: --layout {shlex.quote(layout_arg(replace(lay, split=split)))}"


def trainer_args(spec: LaunchSpec) -> list[str]:
    """continue-pretrain's arguments: the layout as Megatron flags (its pipeline split too), sequence parallelism
    with TP (what plan's memory estimate assumes, and megatron-core requires for MoE), plan's recompute, the
    signal handler, then the user's."""
    lay = spec.layout
    names = {a.split("=", 1)[0] for a in spec.args}
    out = ["--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp)]
    if lay.vpp > 1:
        out += ["--virtual-pipeline-model-parallel-size", str(lay.vpp)]
    if lay.split is not None:
        out += lay.split.flags()
    if lay.cp > 1:
        out += ["--context-parallel-size", str(lay.cp)]
    if lay.ep > 1:
        out += ["--expert-model-parallel-size", str(lay.ep)]
    if lay.etp is not None and lay.etp != lay.tp:
        out += ["--expert-tensor-parallel-size", str(lay.etp)]
    if lay.tp > 1 and "--sequence-parallel" not in names:
        out.append("--sequence-parallel")
    if spec.recompute in ("selective", "full"):
        out += ["--recompute-granularity", spec.recompute]
    if spec.engine is not None:
        out += ["--engine", spec.engine]
    sig = parse_signal(spec.signal)
    if sig:  # SLURM sends it --signal's seconds before the time limit: save, then exit cleanly
        if "--exit-signal-handler" not in names:
            out.append("--exit-signal-handler")
        if "--exit-signal" not in names:
            out += ["--exit-signal", sig[0]]
    return out + list(spec.args)


def _given(args: list[str], flag: str) -> tuple[int, str] | None:
    """(index of the value, value) of the last `flag V` / `flag=V` in args."""
    found = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            found = (i + 1, args[i + 1])
        elif a.startswith(flag + "="):
            found = (i, a.split("=", 1)[1])
    return found


# fields rendered as whole blocks of lines (each line built from checked, quoted pieces)
_BLOCKS = {"ENV", "RESUME", "ARGS", "SBATCH_EXTRA"}


def render(template: str, fields: dict[str, str], name: str) -> str:
    """Replace every {{FIELD}}; a field the template names but we do not fill is an error, not a blank. A one-line
    field holding a newline (or another control character) is refused: it would start a line of its own."""
    def sub(m: re.Match) -> str:
        if m.group(1) not in fields:
            raise PlanError(f"{name}: unknown template field {{{{{m.group(1)}}}}}")
        if m.group(1) not in _BLOCKS:
            check_text(fields[m.group(1)], f"{name}: {{{{{m.group(1)}}}}}")
        return fields[m.group(1)]
    return re.sub(r"\{\{([A-Z_]+)\}\}", sub, template)


def _read_template(name: str, template_dir: Path | None) -> str:
    """A launch template: the package's (plan/templates/, installed with shardkit as package data), or one in
    `template_dir`."""
    where = resources.files("plan").joinpath("templates", name) if template_dir is None else Path(template_dir) / name
    try:
        return where.read_text()
    except OSError as e:
        raise PlanError(f"{where}: cannot read the launch template ({e.strerror or e}); reinstall shardkit (the "
                        "templates are package data)") from None


def run_line(spec: LaunchSpec) -> str:
    """The header line saying what the job runs as `plan` estimated it: recompute, sequence parallelism and the
    optimizer sharding (the layout and its split are on the line above)."""
    lay = spec.layout
    rec = {"selective": "selective recompute", "full": "full recompute", "none": "no recompute"}.get(
        spec.recompute or "", "recompute as given below")
    sp = "sequence parallel" if lay.tp > 1 else "no TP/SP"
    if spec.engine == "native":  # whole parameters per DP rank; CP ranks hold their DP rank's share
        return f"{rec}; {sp}; engine native; optimizer state sharded over DP = {lay.dp} (ZeRO-1, whole parameters)"
    eng = "engine megatron-core; " if spec.engine else ""
    return f"{rec}; {sp}; {eng}optimizer state sharded over DP x CP = {lay.dp * lay.cp} (the distributed optimizer)"


def render_scripts(spec: LaunchSpec, torchrun_path: str = "torchrun.sh",
                   template_dir: Path | None = None) -> dict[str, str]:
    """{"torchrun.sh": ..., "job.sbatch": ...}: the rendered launch scripts."""
    check(spec)
    args = trainer_args(spec)
    resume = ""
    raw: set[int] = set()  # argument positions written unquoted (a shell variable)
    if spec.requeue:
        load, save = _resume_paths(spec)
        from checkpoint.storage import parse, resume_lines

        resume = resume_lines(load, save) if parse(save) else ("# --requeue: a requeued (or resubmitted) job resumes from the newest complete checkpoint in --save\n"
                  f"SHARDKIT_LOAD={shlex.quote(load)}\n"
                  f"if [[ -e {shlex.quote(save)}/latest || -e {shlex.quote(save)}/latest_checkpointed_iteration.txt ]]; "
                  f"then SHARDKIT_LOAD={shlex.quote(save)}; fi\n")  # native, or torch_dist (Megatron's tracker)
        at = _given(args, "--load")
        if at is None or "=" in args[at[0]]:
            args += ["--load", '"$SHARDKIT_LOAD"']  # the last --load wins
            raw.add(len(args) - 1)
        else:
            args[at[0]] = '"$SHARDKIT_LOAD"'
            raw.add(at[0])
    groups: list[list[tuple[int, str]]] = []
    for i, a in enumerate(args):  # one flag and its values per line
        if not groups or (a.startswith("-") and not re.fullmatch(r"-[0-9.e+-]+", a)):
            groups.append([])
        groups[-1].append((i, a))
    lines = ["    " + " ".join(a if i in raw else shlex.quote(a) for i, a in g) for g in groups]
    common = {"LAYOUT": spec.layout.label(), "WORLD": str(spec.layout.world), "NODES": str(spec.nodes),
              "GPUS_PER_NODE": str(spec.gpus_per_node), "MASTER_PORT": str(spec.master_port), "RUN": run_line(spec)}
    torchrun = render(_read_template(TORCHRUN_TEMPLATE, template_dir), {
        **common, "MASTER_ADDR": shlex.quote(spec.master_addr),
        "ENV": "".join(f"export {e.split('=', 1)[0]}={shlex.quote(e.split('=', 1)[1])}\n" for e in spec.env),
        "RESUME": resume, "ARGS": " \\\n".join(lines)}, TORCHRUN_TEMPLATE)
    sig = parse_signal(spec.signal)
    extra = [f"--partition={spec.partition}" if spec.partition else "",
             f"--account={spec.account}" if spec.account else "", f"--qos={spec.qos}" if spec.qos else "",
             "--exclusive" if spec.exclusive else "",
             "--requeue" if spec.requeue else "", "--open-mode=append" if spec.requeue else "",
             f"--signal={sig[0][3:]}@{sig[1]}" if sig else "", *spec.sbatch_extra]
    sbatch = render(_read_template(SBATCH_TEMPLATE, template_dir), {
        **common, "JOB_NAME": spec.job_name, "TIME": spec.time, "LOG_DIR": spec.log_dir,
        "SBATCH_EXTRA": "".join(f"#SBATCH {x}\n" for x in extra if x),
        "TORCHRUN_SCRIPT": shlex.quote(torchrun_path)}, SBATCH_TEMPLATE)
    return {"torchrun.sh": torchrun, "job.sbatch": sbatch}


def _resume_paths(spec: LaunchSpec) -> tuple[str, str]:
    """--requeue: (--load, --save) of the continue-pretrain command line (flags or --config); both are needed."""
    from train.config import from_namespace

    parser, _ = _trainer_parser()
    c = from_namespace(parser.parse_args(trainer_args(spec))).checkpoint
    if not c.save or not c.load:
        raise PlanError("--requeue: the continue-pretrain arguments after `--` need --load and --save (a requeued job "
                        "resumes from the newest complete checkpoint in --save)")
    return c.load, c.save


STAMP = "# written by shardkit launch; sha256 of the lines above: "


def stamped(text: str) -> str:
    """The script as written: its text, then a last line with the sha256 of that text, by which a later launch knows
    the file is its own and unedited (so it may replace it without --overwrite)."""
    text = text if text.endswith("\n") else text + "\n"
    return f"{text}{STAMP}{hashlib.sha256(text.encode()).hexdigest()}\n"


def _ours(path: Path) -> bool:
    """Is the regular file `path` a script shardkit launch wrote and nobody edited since?"""
    try:
        data = read_input(path, limit=4 << 20)
    except Exception:  # noqa: BLE001 - unreadable or not text: not ours
        return False
    body, sep, last = data.rstrip("\n").rpartition("\n")
    return bool(sep) and last.startswith(STAMP) and \
        last[len(STAMP):] == hashlib.sha256((body + "\n").encode()).hexdigest()


def write_scripts(spec: LaunchSpec, out_dir: str | Path, overwrite: bool = False) -> dict[str, Path]:
    """Write torchrun.sh and job.sbatch into `out_dir`. Each name is checked first (checkpoint.safety.check_target):
    a symlink or non-regular file there is refused (never written through), and a file launch did not write (or
    one edited since: see `stamped`) is replaced only with `overwrite`. Each script is written to a temporary file
    beside it and renamed over the name, so a failure leaves the old script or the new one."""
    out = Path(out_dir).resolve()
    scripts = render_scripts(spec, torchrun_path=str(out / "torchrun.sh"))
    for name in scripts:
        p = out / name
        try:
            regular = stat.S_ISREG(os.lstat(p).st_mode)
        except OSError:
            regular = False
        check_target(p, "--out", ours=regular and _ours(p), overwrite=overwrite)
    paths = {}
    try:
        out.mkdir(parents=True, exist_ok=True)
        Path(spec.log_dir).mkdir(parents=True, exist_ok=True)
        for name, text in scripts.items():
            p = out / name
            fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(stamped(text))
                os.chmod(tmp, 0o755)
                os.replace(tmp, p)  # replaces the name itself, never what a link there would point to
            except BaseException:
                if os.path.lexists(tmp):
                    os.unlink(tmp)
                raise
            paths[name] = p
    except OSError as e:
        raise WriteError(f"{out}: cannot write the launch scripts ({e.strerror or e})") from None
    return paths
