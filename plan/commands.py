"""The `shardkit plan` and `shardkit launch` subcommands (registered by shardkit/cli.py)."""
from __future__ import annotations

import argparse
from pathlib import Path

from checkpoint.config import ModelConfig
from checkpoint.errors import ConfigError

from .units import PlanError, parse_bytes


def add_parsers(sub) -> None:
    pl = sub.add_parser("plan", help="per-GPU memory and step time of every TP/PP/VPP/CP/EP/DP layout; ranked")
    pl.add_argument("--model", required=True, metavar="PRESET|HF_DIR|CONFIG_JSON|CKPT",
                    help="a preset name (llama3-70b, deepseek-v3, ...), an HF model directory, its config.json alone or a "
                         "shardkit checkpoint")
    pl.add_argument("--gpus", type=int, required=True, help="total GPUs")
    pl.add_argument("--gpu-memory", default="80GiB", help="memory per GPU, e.g. 80GiB, 141GB (default 80GiB)")
    pl.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node; TP stays inside one (default 8)")
    pl.add_argument("--seq-length", type=int, default=4096)
    pl.add_argument("--global-batch-size", type=int, default=1024, help="sequences per optimizer step (default 1024)")
    pl.add_argument("--micro-batch-size", default="1", metavar="N|N,M,...|auto",
                    help="sequences per micro-batch: one size, several (1,2,4) or auto (1,2,4,8), each layout with "
                         "the sizes that divide its batch (default 1)")
    pl.add_argument("--fp8", action="store_true", help="FP8 GEMMs (Transformer Engine)")
    pl.add_argument("--fp8-recipe", default="delayed", choices=("delayed", "tensorwise", "blockwise"),
                    help="with --fp8: Megatron's --fp8-recipe (default delayed), written on plan's launch command")
    pl.add_argument("--no-fp8-wgrad", dest="fp8_wgrad", action="store_false",
                    help="with --fp8: weight gradients in high precision (Megatron's flag)")
    pl.add_argument("--first-last-layers-bf16", action="store_true",
                    help="with --fp8: the first and last decoder layers in bf16 (Megatron's flag)")
    pl.add_argument("--recompute", default="auto", choices=("auto", "none", "selective", "full"),
                    help="activation recompute; auto tries all three (default)")
    pl.add_argument("--engine", default=None, choices=("megatron-core", "native"),
                    help="continue-pretrain's engine to model: its layer's saved activations, its optimizer sharding "
                         "and DP traffic (default: as continue-pretrain on a GPU cluster: megatron-core where its "
                         "engine runs the layout, native otherwise, e.g. a model it does not build); launch "
                         "gets it as --engine")
    pl.add_argument("--transformer-impl", default=None, choices=("local", "transformer_engine"),
                    help="the layer spec to model and pin on the launch command (continue-pretrain's "
                         "--transformer-impl); default transformer_engine, TE's spec as continue-pretrain builds it by "
                         "default on a GPU with TE, or local where the engine does not build TE's spec for this model")
    pl.add_argument("--kernels", default=None, choices=("fused", "eager", "local"),
                    help="override the activations a layer keeps: fused (TE / flash kernels: Megatron-LM with "
                         "Transformer Engine), eager (the native engine's plain autograd), local (megatron-core's "
                         "local spec); default: the layer spec's (--transformer-impl: TE's fused list, or each "
                         "engine's own on the local spec)")
    pl.add_argument("--overlap-grad-reduce", action=argparse.BooleanOptionalAction, default=True,
                    help="megatron-core's --overlap-grad-reduce (default on; written on plan's launch command)")
    pl.add_argument("--overlap-param-gather", action=argparse.BooleanOptionalAction, default=True,
                    help="megatron-core's --overlap-param-gather (default on; written on plan's launch command)")
    pl.add_argument("--optimizer-sharding", "--use-distributed-optimizer", dest="optimizer_sharding",
                    action=argparse.BooleanOptionalAction, default=True,
                    help="distributed optimizer: Adam state split over DP x CP (ZeRO-1), as continue-pretrain always "
                         "runs (default); --no-optimizer-sharding for a Megatron run without it")
    pl.add_argument("--headroom", default="4GiB", metavar="SIZE",
                    help="memory a layout must leave free to fit: allocator fragmentation, the estimate's error "
                         "(default 4GiB; 0 for none)")
    pl.add_argument("--prefer-common-within", type=float, default=5.0, metavar="PCT",
                    help="a layout of the field's recipes within PCT percent of the fastest estimate ranks before "
                         "an unusual one (CP at short sequences, MoE without EP, stages of < 4 layers); default 5")
    pl.add_argument("--layout", action="append", default=None, metavar="tp=4,pp=4,dp=4",
                    help="estimate this layout only (repeatable; an uneven split as first=N,last=N, or the planner "
                         "picks one); otherwise every layout is enumerated")
    pl.add_argument("--max-cp", type=int, default=None,
                    help="largest context-parallel size to enumerate (the model does not charge CP for smaller "
                         "kernels at short per-GPU sequences; cap it at short sequences)")
    pl.add_argument("--top", type=int, default=10, help="rows of the table (default 10)")
    pl.add_argument("--json", action="store_true", help="print JSON instead of the table")
    pl.add_argument("--plot", metavar="FILE.png", help="bar chart of the memory breakdown of the top layouts")
    hw = pl.add_argument_group("hardware model (defaults: H100/H200 SXM, NVLink 4, 400 Gb/s per GPU)")
    hw.add_argument("--peak-tflops", type=float, default=989.0, help="dense BF16 peak per GPU (default 989)")
    hw.add_argument("--nvlink-bandwidth", type=float, default=450.0, help="GB/s per GPU inside a node (default 450)")
    hw.add_argument("--network-bandwidth", type=float, default=50.0, help="GB/s per GPU between nodes (default 50)")
    hw.add_argument("--compute-efficiency", type=float, default=0.52,
                    help="fraction of peak the kernels reach (default 0.52: matches Megatron-Core's published H100 "
                         "MFU for 7B and 70B)")
    hw.add_argument("--reserved-memory", default="2GiB",
                    help="per-GPU memory taken by CUDA context, NCCL, workspaces (default 2GiB)")

    la = sub.add_parser("launch", help="render torchrun / sbatch scripts for continue-pretrain at a layout, after "
                        "the trainer's start-up checks against --load")
    la.add_argument("--layout", required=True, metavar="tp=8,pp=8,dp=2,first=15,last=15",
                    help="the layout plan chose, as plan prints it: keys tp pp vpp cp ep etp dp, and an uneven "
                         "pipeline split first=N last=N (Megatron's --decoder-first/last-pipeline-num-layers), "
                         "embedding-in-split, loss-in-split or layout=STRING; plan's table label (tp8 pp8 dp2 first15 "
                         "last15) is taken too")
    la.add_argument("--nodes", type=int, required=True)
    la.add_argument("--gpus-per-node", type=int, default=8)
    la.add_argument("--recompute", choices=("none", "selective", "full"), default=None,
                    help="the activation recompute plan chose: written as --recompute-granularity (default: as "
                         "given after `--`, none if not)")
    la.add_argument("--engine", choices=("megatron-core", "native"), default=None,
                    help="continue-pretrain's engine, the one plan modelled: written as --engine (default: as given "
                         "after `--`, else the trainer's default: megatron-core on CUDA where installed)")
    la.add_argument("--skip-load-check", action="store_true",
                    help="do not open --load here (it is not reachable from this machine): the layout is then not "
                         "checked against its model before the job is written (the trainer checks it at start-up)")
    la.add_argument("--slurm", action="store_true", help="print / submit-ready sbatch script (default: torchrun)")
    la.add_argument("--dry-run", action="store_true", help="print the scripts instead of writing them")
    la.add_argument("--out", default="launch", help="directory for torchrun.sh and job.sbatch (default ./launch)")
    la.add_argument("--overwrite", action="store_true",
                    help="replace a torchrun.sh / job.sbatch in --out that launch did not write (or that was edited "
                         "since); a symlink there is always refused")
    la.add_argument("--master-addr", default="127.0.0.1", help="rank-0 host for torchrun (SLURM sets its own)")
    la.add_argument("--master-port", type=int, default=29500)
    la.add_argument("--job-name", default="shardkit-pretrain")
    la.add_argument("--time", default="24:00:00",
                    help="SLURM time limit: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (default 24:00:00)")
    la.add_argument("--partition", help="SLURM partition (or a comma-separated list)")
    la.add_argument("--account", help="SLURM account to charge")
    la.add_argument("--qos", help="SLURM quality of service")
    la.add_argument("--exclusive", action=argparse.BooleanOptionalAction, default=True,
                    help="whole nodes (#SBATCH --exclusive; the default) or --no-exclusive")
    la.add_argument("--requeue", action="store_true",
                    help="#SBATCH --requeue: a preempted or failed job is requeued and resumes from the newest "
                         "complete checkpoint in --save (needs --load and --save after `--`)")
    la.add_argument("--signal", default="USR1@300", metavar="SIG@SECONDS",
                    help="SLURM sends SIG this many seconds before --time runs out; the trainer "
                         "(--exit-signal-handler) saves and exits (default USR1@300; none: no signal)")
    la.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                    help="extra #SBATCH option launch has no flag for: constraint=h100 or --sbatch=--constraint=h100 "
                         "(repeatable)")
    la.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment (repeatable)")
    la.add_argument("trainer_args", nargs=argparse.REMAINDER,
                    help="after `--`: continue-pretrain arguments (--load, --save, --data, batch sizes, ...)")


def resolve_model(model: str) -> tuple[str, ModelConfig]:
    """A preset name, an HF directory (config.json), an HF config.json file or a shardkit checkpoint (its
    manifest's config)."""
    from checkpoint import presets

    from checkpoint.safety import regular_file

    from checkpoint import storage

    if storage.parse(model, "--model") is not None:  # a checkpoint on s3:// / gs://: its manifest, no arrays
        from checkpoint.reader import Checkpoint

        with storage.reading(model, arrays=False, quiet=True) as local:
            return model, Checkpoint(local).config
    path = Path(model)
    if path.exists():
        if not path.is_dir() and regular_file(path, "--model"):  # an HF config.json by itself (a FIFO: one line)
            return str(path), ModelConfig.from_hf_file(path)
        if regular_file(path / "config.json", "--model", missing_ok=True):  # a FIFO there: one line naming it
            return str(path), ModelConfig.from_hf_dir(path)
        from checkpoint.reader import Checkpoint

        return str(path), Checkpoint(path).config
    if model.lower() in presets.PRESETS:
        return model.lower(), presets.model_config(model)
    raise ConfigError(f"--model {model!r}: not a file or directory, and not a known preset; known presets: "
                      f"{', '.join(presets.preset_names())}")


def micro_batch_sizes(text: str) -> list[int]:
    """--micro-batch-size: N, N,M,... or auto (1, 2, 4, 8)."""
    if text.strip().lower() == "auto":
        return [1, 2, 4, 8]
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise PlanError(f"--micro-batch-size {text!r}: expected a positive size, several (1,2,4) or auto")
    return sorted(set(sizes))


def run(args: argparse.Namespace) -> int:
    return _plan(args) if args.cmd == "plan" else _launch(args)


def _plan(args: argparse.Namespace) -> int:
    from checkpoint import storage

    from . import report

    from dataclasses import replace

    from .memory import TrainSettings
    from .perf import Hardware
    from .search import check_gpus, parse_layout, plan, uneven_split

    gpu_memory = parse_bytes(args.gpu_memory, "--gpu-memory")
    reserved = parse_bytes(args.reserved_memory, "--reserved-memory")
    headroom = 0 if args.headroom.strip() in ("0", "0GiB", "0GB") else parse_bytes(args.headroom, "--headroom")
    if headroom >= gpu_memory:
        raise PlanError(f"--headroom {args.headroom} leaves nothing of --gpu-memory {args.gpu_memory}")
    if not 0 <= args.prefer_common_within < 100:
        raise PlanError(f"--prefer-common-within is a percentage in [0, 100), got {args.prefer_common_within}")
    sizes = micro_batch_sizes(args.micro_batch_size)
    for flag, v in (("--peak-tflops", args.peak_tflops), ("--nvlink-bandwidth", args.nvlink_bandwidth),
                    ("--network-bandwidth", args.network_bandwidth), ("--compute-efficiency", args.compute_efficiency)):
        if not 0 < v < float("inf"):  # (inf: an infinitely fast GPU or link, meaningless; issue 34)
            raise PlanError(f"{flag} must be a finite positive number, got {v}")
    if args.compute_efficiency > 1:
        raise PlanError(f"--compute-efficiency is a fraction of peak (0, 1], got {args.compute_efficiency}")
    if args.top < 1:
        raise PlanError(f"--top must be positive, got {args.top}")
    hw = Hardware(peak_tflops=args.peak_tflops, nvlink_gbps=args.nvlink_bandwidth,
                  network_gbps=args.network_bandwidth, compute_efficiency=args.compute_efficiency,
                  gpus_per_node=args.gpus_per_node)
    check_gpus(args.gpus, args.gpus_per_node)
    name, cfg = resolve_model(args.model)
    s = TrainSettings(seq_length=args.seq_length, micro_batch_size=sizes[0],
                      global_batch_size=args.global_batch_size, recompute="none" if args.recompute == "auto" else
                      args.recompute, distributed_optimizer=args.optimizer_sharding, fp8=args.fp8,
                      fp8_recipe=args.fp8_recipe, fp8_wgrad=args.fp8_wgrad,
                      first_last_layers_bf16=args.first_last_layers_bf16,
                      reserved_bytes=reserved, kernels=args.kernels, engine=args.engine or "megatron-core",
                      transformer_impl=args.transformer_impl,
                      overlap_grad_reduce=args.overlap_grad_reduce, overlap_param_gather=args.overlap_param_gather)
    fallback = args.engine is None  # continue-pretrain's default: native where megatron-core's engine does not run
    modes = ["none", "selective", "full"] if args.recompute == "auto" else [args.recompute]
    if args.max_cp is not None and args.max_cp < 1:
        raise PlanError(f"--max-cp must be positive, got {args.max_cp}")
    # a given layout whose stages do not divide the layers gets the uneven split the planner would pick
    layouts = [replace(lay, split=uneven_split(cfg.num_layers, lay.pp, lay.vpp, cfg.mtp_num_layers))
               if lay.split is None else lay
               for lay in (parse_layout(x) for x in args.layout or [])]
    within = args.prefer_common_within / 100
    cands = plan(cfg, args.gpus, gpu_memory, s, hw, recompute=modes, max_cp=args.max_cp, headroom=headroom,
                 micro_batch_sizes=sizes, prefer_within=within, engine_fallback=fallback)
    requested = plan(cfg, args.gpus, gpu_memory, s, hw, recompute=modes, layouts=layouts, headroom=headroom,
                     micro_batch_sizes=sizes, prefer_within=within, engine_fallback=fallback) if layouts else []
    title = (f"{name}: {args.gpus} GPUs x {gpu_memory / 2**30:.1f} GiB ({headroom / 2**30:.1f} GiB headroom), seq "
             f"{s.seq_length}, micro batch {','.join(map(str, sizes))}, global batch {s.global_batch_size}"
             f"{', FP8' if s.fp8 else ''}, optimizer {'sharded' if s.distributed_optimizer else 'not sharded'}, "
             f"engine {args.engine or 'megatron-core (native where it does not run)'}"
             f"{', transformer-impl ' + args.transformer_impl if args.transformer_impl else ''}"
             f"{', kernels ' + args.kernels if args.kernels else ''}")
    chosen = next((c for c in requested + cands if c.fits), None)  # a layout asked for first, else the fastest
    load = name if storage.parse(name) or Path(name).is_dir() and not (Path(name) / "config.json").exists() \
        else None  # a checkpoint (on object storage: its URL, passed through)
    launch = None if chosen is None else report.launch_argv(chosen, args.gpus, args.gpus_per_node, load)
    if args.json:
        out = report.to_json(cands, name, args.gpus, gpu_memory, s, hw, limit=args.top)
        if requested:
            out["requested"] = [c.to_dict() for c in requested]
        out["launch"] = launch
        from checkpoint.progress import json_text

        print(json_text(out))
    else:
        report.print_table(cands, title, gpu_memory, top=args.top, requested=requested, chosen=chosen)
        if launch is not None:
            rest = ["--data-path", "DATA", "--save", "DIR"] + ([] if load else ["--load", "CKPT"])
            print("to run it (DATA, DIR" + ("" if load else ", CKPT") + " yours):")
            print(report.shell_command(launch + rest))
    if args.plot:
        shown = requested + [c for c in cands if c.fits][:args.top] or cands[:args.top]
        path = report.plot(shown, args.plot, gpu_memory, title)
        if not args.json:
            print(f"wrote {path}")
    return 0


def _launch(args: argparse.Namespace) -> int:
    from .launch import LaunchSpec, check_trainer_args, render_scripts, write_scripts
    from .search import parse_layout

    extra = list(args.trainer_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    spec = LaunchSpec(layout=parse_layout(args.layout), log_dir=str(Path(args.out).resolve() / "logs"),
                      nodes=args.nodes, gpus_per_node=args.gpus_per_node, args=tuple(extra),
                      master_addr=args.master_addr, master_port=args.master_port, job_name=args.job_name,
                      time=args.time, sbatch_extra=tuple(x if x.startswith("-") else "--" + x for x in args.sbatch),
                      env=tuple(args.env), partition=args.partition, account=args.account, qos=args.qos,
                      exclusive=args.exclusive, requeue=args.requeue, signal=args.signal, recompute=args.recompute,
                      check_load=not args.skip_load_check, engine=args.engine)
    check_trainer_args(spec)  # the trainer's start-up checks, against --load: a refusal writes nothing
    if args.dry_run:
        out = Path(args.out).resolve()
        scripts = render_scripts(spec, torchrun_path=str(out / "torchrun.sh"))
        order = ["job.sbatch", "torchrun.sh"] if args.slurm else ["torchrun.sh", "job.sbatch"]
        for name in order:
            print(f"# ---- {out / name} ----")
            print(scripts[name], end="" if scripts[name].endswith("\n") else "\n")
        return 0
    paths = write_scripts(spec, args.out, overwrite=args.overwrite)
    if args.slurm:
        print(f"wrote {paths['job.sbatch']} and {paths['torchrun.sh']}; submit with: sbatch {paths['job.sbatch']}")
    else:
        print(f"wrote {paths['torchrun.sh']} and {paths['job.sbatch']}; run on each node with NODE_RANK=0.."
              f"{args.nodes - 1}: bash {paths['torchrun.sh']}")
    return 0
