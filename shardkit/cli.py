"""The `shardkit` command line. Megatron's flag names are accepted as aliases (--tensor-model-parallel-size = --tp).

Every user-facing failure is a ShardkitError: printed as one line naming the culprit, exit status 1.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _layout_flags(p: argparse.ArgumentParser, keep: bool = False) -> None:
    """The layout flags; `keep` (reshard): a flag not given is None and keeps the source's value."""
    default, text = (None, "the source's") if keep else (1, "1")
    p.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=default,
                   help=f"tensor-parallel size (default: {text})")
    p.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp", type=int, default=default,
                   help=f"pipeline-parallel size (default: {text})")
    p.add_argument("--vpp", "--virtual-pipeline-model-parallel-size", dest="vpp", type=int, default=default,
                   help=f"virtual pipeline stages (model chunks) per pipeline rank (default: {text}"
                        + ("; a kept one must fit the new --pp" if keep else "") + ")")
    p.add_argument("--ep", "--expert-model-parallel-size", dest="ep", type=int, default=default,
                   help=f"expert-parallel size: splits the experts of MoE models (default: {text})")
    p.add_argument("--etp", "--expert-tensor-parallel-size", dest="etp", type=int, default=None,
                   help="tensor-parallel size inside each expert (default: "
                        + ("the source's where it differs from the source's TP, else the destination's TP: "
                           "Megatron's --expert-tensor-parallel-size defaults to --tp)" if keep else
                           "same as --tp, Megatron's default)"))
    pipeline_split_flags(p, keep)


def pipeline_split_flags(p: argparse.ArgumentParser, keep: bool = False) -> None:
    """Megatron's uneven pipeline flags (checkpoint.layout.PipelineSplit); `keep` (reshard): none given keeps the
    source's split where --pp and --vpp stay, else the split is even."""
    g = p.add_argument_group("uneven pipeline stages (Megatron's flags; default: "
                             + ("the source's split if --pp/--vpp stay, else even" if keep else "even") + ")")
    g.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None, metavar="N",
                   help="decoder layers on the first pipeline stage; the middle stages share the rest evenly")
    g.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None, metavar="N",
                   help="decoder layers on the last pipeline stage")
    g.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                   help="count the embedding as one layer when splitting: the first stage holds one layer less")
    g.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                   help="count the loss as one layer when splitting: the last stage holds one layer less")
    g.add_argument("--pipeline-model-parallel-layout", default=None, metavar="LAYOUT",
                   help='the layers of each stage in chunk order, e.g. "Et*3|(tt|)*29,m|L" (E embedding, t decoder '
                        "layer, m MTP, L loss, | between stages; megatron-core's PipelineParallelLayerLayout)")


def _skip_verify_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--skip-verify", action="store_true",
                   help="do not check the source checkpoint (manifest, array metadata, every chunk present) before "
                        "writing; chunks are still checksummed as they are read")


def _ranks_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--distributed-timeout-minutes", type=float, default=None, metavar="MIN",
                   help="started as several ranks (torchrun, srun): how long a rank waits for the rendezvous, for "
                        "a rank that shows no sign of life, and in a collective, before it stops naming the rank "
                        "(default: 10, as the trainer's)")
    p.add_argument("--estimate-above", metavar="SIZE", default=None,
                   help="a job with at least this much left to write first measures the output's durable write rate "
                        "on every rank (64 MiB each) and prints the expected time, e.g. 1TB, 0 for any job "
                        "(default: 64GiB)")


def _format_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", choices=("native", "torch_dist"), default="native",
                   help="output format: shardkit's native tensorstore checkpoint, or Megatron-LM's torch_dist "
                        "(--ckpt-format torch_dist)")
    p.add_argument("--key-naming", choices=("te", "local"), default="te",
                   help="torch_dist keys as megatron-core's Transformer Engine spec names them (default) or as its "
                        "local spec does (MoE pre-MLP norm: mlp.linear_fc1.layer_norm_weight)")
    p.add_argument("--verify-integrity", action="store_true",
                   help="with --format torch_dist: write integrity.json (the SHA-256 of every file, as Megatron-LM's "
                        "--verify-integrity save does), which its --verify-integrity load checks; one more read of "
                        "the output, so off by default as in Megatron-LM")
    p.add_argument("--megatron-version", choices=("0.16", "0.19"), default="0.16",
                   help="torch_dist's common-state layout: 0.16 (default) writes common.pt, which megatron-core "
                        "0.13-0.19 and Megatron-Bridge 0.6 all load; 0.19 writes it inside the DCP files as "
                        "megatron-core >= 0.17 does (0.16 cannot load that)")


def _hf_config_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-config", metavar="HF_DIR", default=None,
                   help="for a torch_dist checkpoint shardkit did not write: the HF model directory whose config.json "
                        "describes the model (a shardkit export describes itself; this overrides it)")
    p.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="for a torch_dist checkpoint Megatron-LM wrote: the true vocabulary size, which its args "
                        "usually lack (they hold the padded one); the rest of the model comes from the args")


def _dtype_flag(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--dtype", default=None, help=help)


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line like every other shardkit error (not the usage block): it names the
    command, the flag and what was wrong, and points at --help. Exit status 2, as argparse has it.

    `later_flags(parser)` adds flags the first time the parser is used (parsed, or its help shown): continue-pretrain's
    come from train.config, which imports torch (~1.5 s of CPU), and convert/reshard/inspect do not pay for it."""

    def __init__(self, *args, later_flags=None, **kwargs):
        super().__init__(*args, **kwargs)
        self._later_flags = later_flags

    def _add_later_flags(self) -> None:
        add, self._later_flags = self._later_flags, None
        if add is not None:
            add(self)

    def parse_known_args(self, args=None, namespace=None):
        self._add_later_flags()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self._add_later_flags()
        return super().format_help()

    def error(self, message: str):
        command = self.prog.removeprefix("shardkit").strip()
        line = f"shardkit: error: {command + ': ' if command else ''}{message} (see {self.prog} --help)"
        if command == "continue-pretrain":  # under torchrun: said by one rank, not every rank (train/report.py)
            from train.report import report_error

            report_error(line)
            self.exit(2)
        self.exit(2, line + "\n")


def _workers(text: str) -> int:
    """--workers: a whole number >= 1; more processes than CPUs only cost memory (each imports torch), so it is
    capped at the CPU count."""
    import os

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of processes, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return min(n, os.cpu_count() or 1)


def _trainer_flags(p: argparse.ArgumentParser) -> None:
    """continue-pretrain's flags; their help shows the dataclasses' defaults (argparse's are None: a TOML value
    wins)."""
    from train.config import add_arguments, flag_default

    for action in add_arguments(p):
        try:
            action.shown_default = flag_default(action.dest)
        except KeyError:
            pass
    _show_defaults(p)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="shardkit", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    conv = sub.add_parser("convert", help="convert between HF and Megatron-Core checkpoints")
    csub = conv.add_subparsers(dest="direction", required=True)
    h2m = csub.add_parser("hf-to-mcore", help="HF safetensors -> shardkit checkpoint")
    h2m.add_argument("hf_dir")
    h2m.add_argument("out")
    _layout_flags(h2m)
    _dtype_flag(h2m, "store weights as bf16|fp16|fp32 (default: the source dtype)")
    h2m.add_argument("--keep-fp8", action="store_true",
                     help="block-FP8 sources (DeepSeek-V3): keep the e4m3 weights and their block scales for FP8 "
                          "training instead of dequantizing (recorded in the manifest)")
    h2m.add_argument("--workers", type=_workers, default=None, help="writer processes (at most the CPU count)")
    h2m.add_argument("--allow-nonfinite", action="store_true",
                     help="convert NaN/Inf source weights as they are (default: refuse them, naming the tensor)")
    _format_flags(h2m)
    h2m.add_argument("--make-vocab-size-divisible-by", type=int, default=None, metavar="N",
                     help="with --format torch_dist: pad the vocabulary to a multiple of N x TP, as Megatron-LM's flag "
                          "(default 128); an N the true size is a multiple of (e.g. 8 for 1000 at TP 1) stores it "
                          "unpadded, which Megatron-Bridge 0.6's export_ckpt needs (it exports the rows as stored)")
    h2m.add_argument("--overwrite", action="store_true", help="allow a non-empty output directory: the iteration written here replaces any earlier one of the same number that shardkit wrote; other files are left alone, and one in the way that shardkit did not write is refused")
    h2m.add_argument("--quiet", action="store_true", help="no progress bar")
    h2m.add_argument("--download", action="store_true",
                     help="HF_DIR is a hub repo id not yet in the local hub cache: download it (default: the cache only)")
    h2m.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                     help="right after converting, prove the result (the default; --no-verify skips it): `verify "
                          "--against HF_DIR` (logits and, streamed, every layer vs transformers' own forward); "
                          "non-zero exit if it differs")
    h2m.add_argument("--memory-budget", metavar="SIZE", default=None,
                     help="memory the verify may use (default: 1GiB, or the least the streamed comparison needs)")
    _ranks_flag(h2m)

    m2h = csub.add_parser("mcore-to-hf", help="shardkit checkpoint -> HF safetensors")
    m2h.add_argument("ckpt", help="a native checkpoint, or a torch_dist one")
    m2h.add_argument("out")
    _hf_config_flag(m2h)
    _dtype_flag(m2h, "export as bf16|fp16|fp32 (default: the stored dtype)")
    m2h.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    m2h.add_argument("--quantize-fp8", action="store_true",
                     help="re-quantize the weights that were block-FP8 in the source (DeepSeek-V3) with the same "
                          "block scheme, and keep quantization_config")
    m2h.add_argument("--overwrite", action="store_true")
    m2h.add_argument("--quiet", action="store_true")
    _skip_verify_flag(m2h)
    _ranks_flag(m2h)

    m2m = csub.add_parser("megatron-to-mcore", help="Megatron-LM --ckpt-format torch (mp_rank_* files) -> shardkit "
                          "checkpoint at the same TP/PP/VPP/EP layout (reshard afterwards for another)")
    m2m.add_argument("src", help="checkpoint root (latest_checkpointed_iteration.txt) or an iter_N / release directory")
    m2m.add_argument("out")
    src_cfg = m2m.add_mutually_exclusive_group(required=True)
    src_cfg.add_argument("--hf-config", metavar="HF_DIR", help="HF directory whose config.json describes the model "
                         "(its tokenizer files are carried along)")
    src_cfg.add_argument("--from-args", action="store_true", help="derive the model config from the checkpoint's "
                         "Megatron-LM args (needs --vocab-size)")
    m2m.add_argument("--vocab-size", type=int, default=None, help="true vocabulary size (args hold the padded one)")
    from checkpoint.families import megatron_model_types

    m2m.add_argument("--model-type", default="llama", choices=megatron_model_types())
    m2m.add_argument("--workers", type=_workers, default=None, help="writer processes (at most the CPU count)")
    m2m.add_argument("--overwrite", action="store_true")
    m2m.add_argument("--quiet", action="store_true")

    t2m = csub.add_parser("torchtitan-to-mcore", help="torchtitan DCP checkpoint (step-N/; Llama 3, DeepSeek-V3) -> "
                          "shardkit checkpoint")
    t2m.add_argument("src", help="a torchtitan step-N directory, or its checkpoint folder (the newest step-N)")
    t2m.add_argument("out")
    t2m_cfg = t2m.add_mutually_exclusive_group()
    t2m_cfg.add_argument("--model-flavor", metavar="FLAVOR", default=None,
                         help="the torchtitan flavour (e.g. 8B, debugmodel), read from torchtitan's own registry")
    t2m_cfg.add_argument("--job-config", metavar="TOML", default=None,
                         help="torchtitan's job config: its [model] name and flavor")
    t2m_cfg.add_argument("--hf-config", metavar="HF_DIR", default=None,
                         help="an HF directory whose config.json describes the model")
    t2m.add_argument("--model-name", default="llama3", choices=["llama3", "deepseek_v3"],
                     help="torchtitan model of --model-flavor (default llama3)")
    _layout_flags(t2m)
    _dtype_flag(t2m, "store weights as bf16|fp16|fp32 (default: the source dtype)")
    t2m.add_argument("--optimizer", action="store_true",
                     help="a full training checkpoint of torchtitan's AdamW: convert its moments too (a native "
                          "training checkpoint that continue-pretrain resumes); needs --global-batch-size")
    t2m.add_argument("--global-batch-size", type=int, default=None, metavar="N",
                     help="with --optimizer: the run's samples per step (consumed samples = N x step)")
    t2m.add_argument("--workers", type=_workers, default=None, help="writer processes (at most the CPU count)")
    t2m.add_argument("--allow-nonfinite", action="store_true",
                     help="convert NaN/Inf source weights as they are (default: refuse them, naming the tensor)")
    _format_flags(t2m)
    t2m.add_argument("--overwrite", action="store_true")
    t2m.add_argument("--quiet", action="store_true")

    m2t = csub.add_parser("mcore-to-torchtitan", help="shardkit checkpoint -> torchtitan DCP (model-only step-N/; "
                          "Llama 3, DeepSeek-V3)")
    m2t.add_argument("ckpt", help="a native checkpoint")
    m2t.add_argument("out", help="torchtitan's checkpoint folder: step-N/ is written in it")
    _dtype_flag(m2t, "write as bf16|fp16|fp32 (default: the stored dtype)")
    m2t.add_argument("--step", type=int, default=None, help="N of step-N (default: the checkpoint's iteration)")
    m2t.add_argument("--torchtitan-names", choices=["0.3", "0.1-0.2"], default="0.3",
                     help="torchtitan's key names: 0.3 (attention.qkv_linear.wq, lm_head) or 0.1-0.2 (attention.wq, "
                          "output); default 0.3")
    m2t.add_argument("--optimizer", action="store_true",
                     help="a native training checkpoint: write torchtitan's full training checkpoint (fp32 weights, "
                          "AdamW state and param groups, lr_scheduler, train_state; no dataloader entry)")
    m2t.add_argument("--overwrite", action="store_true")
    m2t.add_argument("--quiet", action="store_true")

    rs = sub.add_parser("reshard", help="rewrite a checkpoint for another TP/PP/VPP/EP layout (offline); flags not "
                        "given keep the source's values")
    rs.add_argument("src", help="a native checkpoint, or a torch_dist one")
    rs.add_argument("dst")
    _layout_flags(rs, keep=True)
    _format_flags(rs)
    _hf_config_flag(rs)
    _dtype_flag(rs, "cast weights to bf16|fp16|fp32 (default: keep; kept-FP8 weights stay FP8)")
    rs.add_argument("--workers", type=_workers, default=None, help="writer processes (at most the CPU count)")
    rs.add_argument("--overwrite", action="store_true", help="allow a non-empty destination directory")
    rs.add_argument("--quiet", action="store_true", help="no progress bar, no layout line")
    _skip_verify_flag(rs)
    _ranks_flag(rs)

    ins = sub.add_parser("inspect", help="layout, model config and tensor table of a checkpoint (native or "
                         "torch_dist)")
    ins.add_argument("ckpt")
    _hf_config_flag(ins)
    ins.add_argument("--json", action="store_true")

    ver = sub.add_parser("verify", help="re-read every chunk (native) or item (torch_dist); optionally compare "
                         "logits with an HF model")
    ver.add_argument("ckpt")
    _hf_config_flag(ver)
    ver.add_argument("--against", metavar="HF_DIR", help="HF model directory to compare logits with (fp32)")
    ver.add_argument("--against-torchtitan", metavar="DIR", default=None,
                     help="a torchtitan DCP checkpoint (step-N/ or its folder): every weight compared, values equal")
    ver.add_argument("--tolerance", type=float, default=1e-4, help="max abs logit difference allowed (1e-4)")
    ver.add_argument("--seq-length", type=int, default=32)
    ver.add_argument("--streaming", action="store_true",
                     help="with --against: compare layer by layer, one layer's weights in memory at a time (default: "
                          "only when both fp32 models would not fit in --memory-budget)")
    ver.add_argument("--memory-budget", metavar="SIZE", default=None,
                     help="with --against: memory the comparison may use, e.g. 4GiB (default: 1GiB, or the least the "
                          "streamed comparison needs)")
    ver.add_argument("--all-experts", action="store_true",
                     help="with --against (streaming): also drive synthetic tokens through every routed expert the "
                          "test tokens do not select, and compare each")
    ver.add_argument("--json", action="store_true")
    ver.add_argument("--quiet", action="store_true")

    sub.add_parser("continue-pretrain", help="train from a checkpoint (torchrun for several processes); "
                   "Megatron-LM's flag names", later_flags=_trainer_flags)
    _data_parsers(sub)  # preprocess-data, plot

    demo = sub.add_parser("demo", help="build a tiny LLaMA locally and run the whole pipeline on it")
    demo.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    demo.add_argument("--keep", action="store_true", help="keep the work directory")

    from plan.commands import add_parsers as add_plan_parsers  # plan, launch

    add_plan_parsers(sub)
    _show_defaults(ap)
    return ap


def _default_text(action: argparse.Action) -> str | None:
    """How a flag's help names its default: argparse's, or `shown_default` where argparse's is only a placeholder
    (the trainer's flags), on/off for switches; None where the help already says it in words."""
    text = action.help or ""
    if (not action.option_strings or action.default is argparse.SUPPRESS or text is argparse.SUPPRESS
            or "%(default)" in text or "default" in text.lower()
            or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
        return None
    d = getattr(action, "shown_default", action.default)
    if action.nargs == 0:  # a switch: is its effect the default?
        return "on" if d is not None and d == action.const else "off"
    if d is None or d == "" or d == () or d == []:
        return "none"
    return " ".join(map(str, d)) if isinstance(d, (list, tuple)) else str(d)


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every optional flag of every subcommand ends its help with its default."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_defaults(sub)
            continue
        shown = _default_text(action)
        if shown is not None:
            action.help = f"{action.help or ''} (default: {shown.replace('%', '%%')})".lstrip()


def _data_parsers(sub) -> None:
    """`preprocess-data` (JSONL -> Megatron .bin/.idx) and `plot` (loss/lr curves of a training run)."""
    pre = sub.add_parser("preprocess-data", help="tokenize a JSONL file into Megatron's .bin/.idx (what "
                         "Megatron-LM's tools/preprocess_data.py writes)")
    pre.add_argument("--input", required=True, metavar="FILE.jsonl", help="one JSON object per line")
    pre.add_argument("--json-keys", nargs="+", default=["text"], help="keys to tokenize (default: text); with "
                     "several keys each gets PREFIX_<key>_document.bin/.idx")
    pre.add_argument("--tokenizer", "--tokenizer-model", dest="tokenizer", required=True, metavar="HF_DIR",
                     help="local HF tokenizer (or model) directory; remote code is never run")
    pre.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    pre.add_argument("--append-eod", action="store_true", help="append the tokenizer's EOS after each document")
    pre.add_argument("--add-special-tokens", action="store_true",
                     help="let the tokenizer add its special tokens (e.g. BOS) to each text (default: none)")
    pre.add_argument("--workers", type=_workers, default=1, help="tokenizer processes (default 1, at most the CPU "
                     "count)")
    pre.add_argument("--quiet", action="store_true", help="no progress bar")

    plot = sub.add_parser("plot", help="PNG of the loss and learning-rate curves of a run (its metrics.jsonl)")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="directory holding metrics.jsonl (or the file itself)")
    plot.add_argument("--output", "-o", default=None, metavar="FILE.png", help="default: RUN_DIR/metrics.png")


def main(argv: list[str] | None = None) -> int:
    from checkpoint.errors import ShardkitError

    args = build_parser().parse_args(argv)
    from checkpoint.malloc import tune_malloc

    tune_malloc()
    try:
        if args.cmd == "convert" and args.direction == "hf-to-mcore" and args.verify is not False:
            from checkpoint.rendezvous import launcher_rank

            if launcher_rank(os.environ) in (None, 0):  # rank 0 proves: the proof's imports while the rest runs
                from convert import proof_process

                proof_process.start()  # (taken up by _dispatch_local: proof_process.waiting)
        _refuse_urls(sys.argv[1:] if argv is None else argv, _storage_values(args))
        if args.cmd in ("convert", "reshard"):
            return _across_ranks(args)
        return _dispatch(args)
    except ShardkitError as e:  # one write per line: ranks sharing a stderr pipe never split each other's lines
        if args.cmd == "continue-pretrain":  # found alike on every rank: said once per job (train/report.py)
            from train.report import report_error

            report_error(f"shardkit: error: {e}")
            return 1
        sys.stderr.write(f"shardkit: error: {e}\n")
        return 1
    except KeyboardInterrupt:
        print(_interrupted_line(args), file=sys.stderr)
        return 130
    except Exception as e:  # Ctrl-C inside an import can surface wrapped, the interrupt chained: a compiled module's
        if not _interrupted(e):  # ImportError (tensorstore's pybind11 init), a class body's __set_name__ RuntimeError
            raise
        print(_interrupted_line(args), file=sys.stderr)
        return 130
    finally:  # convert hf-to-mcore's proof process never outlives the command, whichever way it ends
        from convert.proof_process import close_all

        close_all()


# the commands whose rerun resumes (or redoes) what an interrupt stopped: the writers' partial output (job.json and
# its resume log), a training run's saves; the others (inspect, verify, plan, launch, plot, preprocess-data, demo)
# promise no resume
_RESUMING = ("convert", "reshard", "continue-pretrain")


def _interrupted_line(args) -> str:
    """What Ctrl-C says (status 130): a rerun resumes only where the command resumes."""
    if args.cmd in _RESUMING:
        return "shardkit: interrupted; rerun the same command to resume"
    return "shardkit: interrupted"


def _interrupted(e: BaseException) -> bool:
    """A KeyboardInterrupt is in `e`'s chain of causes (an exception raised while handling it, or from it)."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, KeyboardInterrupt):
            return True
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return False


def _refuse_urls(argv: list, allowed: set = frozenset()) -> None:
    """A path argument that is a URL (`s3://bucket/x`, `gs://`, `https://`) is one line naming it, never a relative
    directory named `s3:`, unless it is one of the command's checkpoint arguments (`allowed`, _storage_args), which
    take object storage (checkpoint/storage.py)."""
    from checkpoint.safety import is_url, refuse_url

    for i, a in enumerate(map(str, argv)):
        flag, _, value = a.partition("=") if a.startswith("--") else ("", "", a)
        if is_url(value) and value not in allowed:
            prev = str(argv[i - 1]) if i else ""
            refuse_url(value, flag or (prev if prev.startswith("-") else ""))


def _storage_args(args: argparse.Namespace) -> list[tuple[str, str]]:
    """The checkpoint arguments of a command that take object storage (s3://, gs://, file://), with "r" (read),
    "m" (read its small files: manifest, train state, hf/) or "w" (write)."""
    cmd, direction = args.cmd, getattr(args, "direction", None)
    return {("convert", "hf-to-mcore"): [("out", "w")], ("convert", "mcore-to-hf"): [("ckpt", "r")],
            ("reshard", None): [("src", "r"), ("dst", "w")], ("inspect", None): [("ckpt", "m")],
            ("verify", None): [("ckpt", "r")],
            ("continue-pretrain", None): [("load", "r"), ("save", "w")]}.get((cmd, direction), [])


def _storage_values(args: argparse.Namespace) -> set:
    values = {getattr(args, a, None) for a, _ in _storage_args(args)}
    if args.cmd == "plan":  # a checkpoint on object storage: its config, and its URL as --load (plan/commands.py)
        values.add(getattr(args, "model", None))
    if args.cmd == "launch":  # continue-pretrain's --load / --save after `--`: into the scripts (plan/launch.py)
        extra = [str(a) for a in getattr(args, "trainer_args", None) or []]
        for i, a in enumerate(extra):
            flag, eq, value = a.partition("=")
            if flag in ("--load", "--save"):
                values.add(value if eq else extra[i + 1] if i + 1 < len(extra) else None)
    return values - {None}


def _dispatch(args: argparse.Namespace) -> int:
    """Run the command with its object-storage checkpoint arguments made local: a source is downloaded (the
    iteration it resolves to), an output is written to a staging root and published when the command succeeds
    (checkpoint/storage.py). continue-pretrain does the same once its --config is merged (_train_storage)."""
    from checkpoint import storage
    from checkpoint.errors import ShardkitError

    spots = [(a, m) for a, m in _storage_args(args) if args.cmd != "continue-pretrain"
             and storage.parse(getattr(args, a, None), a.upper()) is not None]
    for a, _ in _storage_args(args):
        if isinstance(getattr(args, a, None), str):
            setattr(args, a, storage.local(getattr(args, a)))  # file://
    if not spots:
        return _dispatch_local(args)
    import contextlib

    with contextlib.ExitStack() as stack:
        writers = []
        for a, mode in spots:
            value = getattr(args, a)
            if mode in "rm":
                setattr(args, a, stack.enter_context(storage.reading(value, arrays=mode == "r",
                                                                     quiet=getattr(args, "quiet", False))))
                continue
            if getattr(args, "format", "native") == "torch_dist":
                raise ShardkitError(f"{value}: " + storage.TORCH_DIST_REFUSED.format(scheme=value.split(":")[0]))
            w = storage.Writing(value, overwrite=getattr(args, "overwrite", False), flag=a.upper())
            setattr(args, a, w.path)
            writers.append(w)
        rc = _dispatch_local(args)
        if rc == 0:
            for w in writers:
                print(f"published {w.publish(quiet=getattr(args, 'quiet', False))}")
        return rc


def _train_storage(cfg, stack):
    """continue-pretrain's --load / --save on object storage, on any number of ranks: --load is downloaded (one
    copy per node, shared by its ranks); --save stands for the store (checkpoint.storage.mirror): every save, sync or async, goes
    straight there, each rank its own chunk objects (train/checkpointing.py); --load equal to --save resumes from
    the store's latest."""
    import dataclasses

    from checkpoint import storage

    load, save = cfg.checkpoint.load, cfg.checkpoint.save
    new_load, new_save = storage.local(load), storage.local(save)
    if save and storage.parse(save, "--save") is not None:
        if cfg.checkpoint.save_format == "torch_dist":
            from checkpoint.errors import ShardkitError

            raise ShardkitError(f"--save {save}: " + storage.TORCH_DIST_REFUSED.format(scheme=save.split(":")[0]))
        w = storage.Writing(save, overwrite=True, flag="--save", ranks=True)
        new_save = w.path
        storage.mirror(w.path, w.loc)
        stack.push(lambda *exc: storage.release(w.path, failed=exc[0] is not None))  # the run's files, to the store
    if load and storage.parse(load, "--load") is not None:  # (equal to --save: the store's latest, resumed)
        new_load = stack.enter_context(storage.reading(load, ranks=True))
    if (new_load, new_save) == (load, save):
        return cfg
    return dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=new_load, save=new_save))


def _check_dtype(value: str | None) -> str | None:
    from checkpoint import store
    from checkpoint.errors import ShardkitError

    if value is None:
        return None
    try:
        return store.dtype_name(value)
    except ShardkitError as e:
        raise ShardkitError(f"--dtype: {e}") from None


def _hf_dir_arg(value: str | None, download: bool = False) -> str | None:
    """An HF directory argument: a local directory, or a hub repo id resolved through the local hub cache."""
    if value is None:
        return None
    from checkpoint.hf_source import resolve_hf_dir

    return str(resolve_hf_dir(value, download=download))


def _check_outputs(args: argparse.Namespace) -> None:
    """The one rule for every command that writes: its output is not, does not contain and does not lie inside any
    of its inputs (checkpoint.safety.check_output), checked before anything is written. continue-pretrain is checked
    in _dispatch once its --config file is merged (train/flagcheck.py check_train_outputs)."""
    from checkpoint.safety import check_output
    from train.flagcheck import data_files

    cmd, direction = args.cmd, getattr(args, "direction", None)
    if cmd == "convert" and direction in ("hf-to-mcore", "mcore-to-hf", "megatron-to-mcore"):
        src = {"hf-to-mcore": args.__dict__.get("hf_dir"), "mcore-to-hf": args.__dict__.get("ckpt"),
               "megatron-to-mcore": args.__dict__.get("src")}[direction]
        check_output(args.out, [("source", src), ("--hf-config", getattr(args, "hf_config", None))], "OUT")
    elif cmd == "reshard":
        check_output(args.dst, [("SRC", args.src), ("--hf-config", args.hf_config)], "DST")
    elif cmd == "preprocess-data":
        from train.data.preprocess import output_prefixes

        for prefix in output_prefixes(args.output_prefix, args.json_keys).values():
            for ext in (".bin", ".idx"):
                check_output(f"{prefix}{ext}", [("--input", args.input), ("--tokenizer", args.tokenizer)],
                             "--output-prefix")
    elif cmd == "plot":
        src = Path(args.run_dir)
        metrics = src / "metrics.jsonl" if src.is_dir() else src
        out = args.output or (src if src.is_dir() else src.parent) / "metrics.png"
        check_output(out, [("metrics", metrics)], "--output")
    elif cmd == "plan" and getattr(args, "plot", None):
        check_output(args.plot, [("--model", args.model if Path(args.model).exists() else None)], "--plot")
    elif cmd == "launch" and not getattr(args, "dry_run", False):
        extra, inputs = list(getattr(args, "trainer_args", []) or []), []
        for i, a in enumerate(extra):
            if a == "--load" and i + 1 < len(extra):
                inputs.append(("--load", extra[i + 1]))
            elif a in ("--data-path", "--data"):
                vals = []
                for v in extra[i + 1:]:
                    if v.startswith("--"):
                        break
                    vals.append(v)
                inputs += data_files(vals)
        check_output(args.out, inputs, "--out")


def _across_ranks(args: argparse.Namespace) -> int:
    """hf-to-mcore and reshard started as several ranks (torchrun, or one SLURM task per rank), into either format
    and (reshard) from either, and mcore-to-hf from either: rendezvous, compare the ranks' arguments,
    run the command with every rank writing its share (convert.distributed: chunks, torch_dist rank files, or
    safetensors shards); a rank that fails tells the others why, so they stop naming it. Other writing commands run
    as one process."""
    from checkpoint.errors import ShardkitError
    from checkpoint.rendezvous import rank_and_world
    from convert import distributed

    command = "reshard" if args.cmd == "reshard" else f"convert {args.direction}"
    from train.flagcheck import check_timeout_minutes

    check_timeout_minutes(getattr(args, "distributed_timeout_minutes", None))  # NaN/inf/<= 0: one line (issue 34)
    found = rank_and_world(os.environ, command)
    if found is None or found[1] == 1:
        return _dispatch(args)
    from checkpoint.storage import parse

    urls = [v for a, v in ((a, getattr(args, a, None)) for a, _ in _storage_args(args)) if parse(v, a.upper())]
    if urls:  # before any rendezvous: every rank says the same line
        raise ShardkitError(f"{urls[0]}: object storage runs as one process for now (rank {found[0]} of "
                            f"{found[1]} here); start {command} without torchrun/srun, or use a shared filesystem")
    if args.cmd == "convert" and args.direction not in ("hf-to-mcore", "mcore-to-hf"):
        raise ShardkitError(f"{command} runs as one process (rank {found[0]} of {found[1]} here): start it "
                            "without torchrun/srun; hf-to-mcore, mcore-to-hf and reshard run across ranks")
    group = distributed.start(command, dict(vars(args)), args.distributed_timeout_minutes)
    if group is None:
        return _dispatch(args)
    args.group = group
    error = None
    try:
        return _dispatch(args)
    except BaseException as e:
        group.fail(e)
        error = e
        raise
    finally:
        group.close(error)


def _dispatch_local(args: argparse.Namespace) -> int:
    from checkpoint.errors import ShardkitError

    if args.cmd == "convert" and args.direction == "hf-to-mcore":
        args.hf_dir = _hf_dir_arg(args.hf_dir, download=args.download)
        from convert import proof_process

        proof = proof_process.waiting()  # started by main, importing
        if proof is not None:
            proof.source(args.hf_dir)
    if getattr(args, "hf_config", None):
        args.hf_config = _hf_dir_arg(args.hf_config)
    if args.cmd == "verify" and args.against:  # hub repo ids from the local cache wherever an HF directory is read
        args.against = _hf_dir_arg(args.against)
    if args.cmd == "preprocess-data":
        args.tokenizer = _hf_dir_arg(args.tokenizer)
    if args.cmd == "plan" and "/" in args.model and "://" not in args.model:  # (s3://...: plan/commands.py)
        args.model = _hf_dir_arg(args.model)
    _check_outputs(args)
    if args.cmd == "convert" and args.direction == "hf-to-mcore":
        from checkpoint.layout import Layout, PipelineSplit
        from convert.hf_to_mcore import convert_hf_to_mcore

        dtype = _check_dtype(args.dtype)
        if args.memory_budget is not None:  # the proof's flag: a typo is one line now, not after the whole write
            from plan.units import parse_bytes

            parse_bytes(args.memory_budget, "--memory-budget")
        layout = Layout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp,
                        split=PipelineSplit.from_args(args))
        if args.format != "torch_dist" and args.make_vocab_size_divisible_by is not None:
            raise ShardkitError("--make-vocab-size-divisible-by goes with --format torch_dist (a native checkpoint "
                                "keeps 128 and re-pads for each layout; reshard it to torch_dist)")
        if args.format == "torch_dist" and args.keep_fp8:
            raise ShardkitError("--keep-fp8 with --format torch_dist: Megatron's torch_dist has no block-FP8 "
                                "weights; drop --keep-fp8 (weights are dequantized) or write the native format")
        group = getattr(args, "group", None)
        proof = proof if group is None or not group.rank else None  # (the one taken up above; rank 0 proves)
        if args.format == "torch_dist":  # straight into the rank files, no native copy between
            from convert.torch_dist_io import convert_hf_to_torch_dist

            path = convert_hf_to_torch_dist(args.hf_dir, args.out, layout, dtype=dtype, key_naming=args.key_naming,
                                            overwrite=args.overwrite, quiet=args.quiet,
                                            allow_nonfinite=args.allow_nonfinite, group=group,
                                            estimate_above=_estimate_above(args),
                                            megatron_version=args.megatron_version, integrity=args.verify_integrity,
                                            make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
        else:
            path = _write(args, args.out, lambda out: convert_hf_to_mcore(
                args.hf_dir, out, layout, dtype=dtype, workers=args.workers, overwrite=args.overwrite,
                quiet=args.quiet, keep_fp8=args.keep_fp8, allow_nonfinite=args.allow_nonfinite, group=group,
                estimate_above=_estimate_above(args)))
        if group is not None and group.rank:  # rank 0 says what was written (and verifies it)
            return 0
        print(f"wrote {path}")
        if args.verify is False:
            return 0
        from convert.hf_to_mcore import verify_conversion

        return verify_conversion(path, args.hf_dir, memory_budget=args.memory_budget,
                                 quiet=args.quiet, asked=bool(args.verify), allow_nonfinite=args.allow_nonfinite,
                                 withdraw=True, process=proof)  # a failed or interrupted proof commits nothing
    if args.cmd == "convert" and args.direction == "mcore-to-hf":
        from convert.mcore_to_hf import convert_mcore_to_hf

        dtype = _check_dtype(args.dtype)
        group = getattr(args, "group", None)
        path = convert_mcore_to_hf(args.ckpt, args.out, dtype=dtype, max_shard_size=args.max_shard_size,
                                   overwrite=args.overwrite, quiet=args.quiet, quantize_fp8=args.quantize_fp8,
                                   skip_verify=args.skip_verify, group=group, estimate_above=_estimate_above(args),
                                   hf_config=args.hf_config, vocab_size=args.vocab_size)
        if group is not None and group.rank:  # rank 0 says what was written
            return 0
        print(f"wrote {path}")
        return 0
    if args.cmd == "convert" and args.direction == "megatron-to-mcore":
        from checkpoint.config import ModelConfig
        from convert.megatron_legacy import config_from_megatron_args, legacy_to_native, read_legacy_args

        cfg = (ModelConfig.from_hf_dir(args.hf_config) if args.hf_config else
               config_from_megatron_args(read_legacy_args(args.src), args.model_type, vocab_size=args.vocab_size))
        path = legacy_to_native(args.src, args.out, cfg, overwrite=args.overwrite, quiet=args.quiet,
                                workers=args.workers, hf_dir=args.hf_config)
        print(f"wrote {path}")
        return 0
    if args.cmd == "convert" and args.direction == "torchtitan-to-mcore":
        from checkpoint.layout import Layout, PipelineSplit
        from convert.torchtitan import convert_torchtitan_to_mcore, model_config

        dtype = _check_dtype(args.dtype)
        layout = Layout(tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, etp=args.etp,
                        split=PipelineSplit.from_args(args))
        cfg = model_config(args.src, flavor=args.model_flavor, name=args.model_name, job_config=args.job_config,
                           hf_config=args.hf_config)
        path = _write(args, args.out, lambda out: convert_torchtitan_to_mcore(
            args.src, out, layout, cfg, dtype=dtype, workers=args.workers, overwrite=args.overwrite,
            quiet=args.quiet, allow_nonfinite=args.allow_nonfinite, optimizer=args.optimizer,
            global_batch_size=args.global_batch_size))
        print(f"wrote {path}")
        return 0
    if args.cmd == "convert" and args.direction == "mcore-to-torchtitan":
        from convert.torchtitan import convert_mcore_to_torchtitan

        path = convert_mcore_to_torchtitan(args.ckpt, args.out, dtype=_check_dtype(args.dtype),
                                           generation=args.torchtitan_names, step=args.step,
                                           overwrite=args.overwrite, quiet=args.quiet, optimizer=args.optimizer)
        print(f"wrote {path}")
        return 0
    if args.cmd == "reshard":
        from convert.torchtitan import is_torchtitan, reshard_torchtitan

        if is_torchtitan(args.src):  # a torchtitan DCP folder: converted straight into the layout asked for
            print(f"wrote {_write(args, args.dst, lambda out: reshard_torchtitan(args, out))}")
            return 0
        from convert.reshard import LAYOUT_FLAGS, keep_layout, layout_change, reshard

        dtype = _check_dtype(args.dtype)
        given = {f: getattr(args, f) for f in LAYOUT_FLAGS}
        ck, source, cfg, unknown = _reshard_source(args)
        from checkpoint.layout import PipelineSplit

        # a flag not given keeps the source's value
        layout = keep_layout(source, cfg, **given, split=PipelineSplit.from_args(args))
        group = getattr(args, "group", None)
        if not args.quiet and (group is None or not group.rank):  # before it starts; stdout with the "wrote" line
            print(layout_change(source, layout, cfg, given, unknown), flush=True)
        # the source opened once (checkpoint.opened) tells the formats apart; each writer reads it in place by path,
        # after its own output checks, in every worker process it starts
        if ck.format == "torch_dist":  # torch_dist -> native: the import reads the items in place and re-chunks
            # -> torch_dist: through a native staging copy, as write_torch_dist's rank-file workers read a native one
            path = _write(args, args.dst, lambda out: _import_torch_dist(args, args.src, out, layout, dtype))
        elif args.format == "torch_dist":  # native -> torch_dist: reshard and export in one pass, no staging copy
            from convert.torch_dist_io import write_torch_dist

            path = write_torch_dist(args.src, args.dst, layout=layout, dtype=dtype, key_naming=args.key_naming,
                                    overwrite=args.overwrite, quiet=args.quiet, workers=args.workers,
                                    skip_verify=args.skip_verify, group=group,
                                    estimate_above=_estimate_above(args), megatron_version=args.megatron_version,
                                    integrity=args.verify_integrity)
        else:
            path = _write(args, args.dst, lambda out: reshard(args.src, out, layout, dtype=dtype,
                                                              workers=args.workers, overwrite=args.overwrite,
                                                              quiet=args.quiet, skip_verify=args.skip_verify,
                                                              group=group, estimate_above=_estimate_above(args)))
        if group is not None and group.rank:
            return 0
        print(f"wrote {path}")
        return 0
    if args.cmd == "inspect":
        return _inspect(args)
    if args.cmd == "verify" and args.against_torchtitan:
        from convert.torchtitan import verify_against_torchtitan

        if args.against:
            raise ShardkitError("verify: --against and --against-torchtitan: give one")
        return verify_against_torchtitan(args.ckpt, args.against_torchtitan, as_json=args.json, quiet=args.quiet)
    if args.cmd == "verify":
        return _verify(args)
    if args.cmd == "continue-pretrain":
        from train.config import from_namespace
        from train.failures import peer_failure
        from train.engines import main as train_main

        if getattr(args, "config", None):  # the TOML is read next: a FIFO there would block it forever
            from checkpoint.safety import regular_file

            regular_file(args.config, "--config", missing_ok=True)
        cfg = from_namespace(args)
        from train.flagcheck import check_train_outputs, check_train_values

        check_train_values(cfg)  # NaN/inf/out-of-range --lr, --adam-eps, --clip-grad, timeouts... (issue 34)
        import contextlib

        with contextlib.ExitStack() as stack:
            cfg = _train_storage(cfg, stack)  # s3:// / gs:// --load and --save (checkpoint/storage.py)
            check_train_outputs(cfg)
            try:
                train_main(cfg)
            except RuntimeError as e:  # a collective failed: another rank died or hangs
                err = peer_failure(e, cfg.checkpoint.save)
                if err is None:
                    raise
                raise err from None
            from checkpoint.storage import release

            release(cfg.checkpoint.save)  # a --save s3://... staging root, every save published
        return 0
    if args.cmd in ("plan", "launch"):
        from plan.commands import run as run_plan

        return run_plan(args)
    if args.cmd == "preprocess-data":
        from train.data.preprocess import preprocess_main

        return preprocess_main(args)
    if args.cmd == "plot":
        from train.metrics import plot_main

        return plot_main(args)
    if args.cmd == "demo":
        from shardkit.demo import run_demo

        return run_demo(main, args.out, keep=args.keep)
    raise AssertionError(args)


def _estimate_above(args: argparse.Namespace) -> int | None:
    """--estimate-above in bytes (None: the default threshold); "0" for every job."""
    if args.estimate_above is None:
        return None
    if args.estimate_above.strip() == "0":
        return 0
    from plan.units import parse_bytes

    return parse_bytes(args.estimate_above, "--estimate-above")


def _reshard_source(args: argparse.Namespace):
    """reshard: the source opened (checkpoint.opened), its layout (None where a torch_dist source's common.pt has no
    Megatron args, with the reason), and the model config the destination layout is checked against (a torch_dist
    source's from --hf-config, its own shardkit.json, or its Megatron args with --vocab-size: one line naming what
    is missing)."""
    from checkpoint.opened import open_checkpoint

    ck = open_checkpoint(args.src, getattr(args, "hf_config", None), getattr(args, "vocab_size", None))
    if ck.format == "native":
        return ck, ck.layout, ck.config, ""
    return ck, ck.td.layout, ck.config, f"{ck.td.args_source} holds no usable Megatron args"


def _import_torch_dist(args: argparse.Namespace, src: str, out, layout, dtype):
    from convert.torch_dist_io import torch_dist_to_native

    return torch_dist_to_native(src, out, None, layout, dtype=dtype, hf_dir=args.hf_config,
                                vocab_size=args.vocab_size, workers=getattr(args, "workers", None),
                                overwrite=args.overwrite, quiet=args.quiet, group=getattr(args, "group", None),
                                estimate_above=_estimate_above(args) if hasattr(args, "estimate_above") else None)


def _write(args: argparse.Namespace, out: str, produce):
    """Run a producer of a native checkpoint at `out`, or through a staging native checkpoint into torch_dist."""
    if args.format == "native":
        return produce(out)
    from convert.torch_dist_io import via_native

    return via_native(produce, out, key_naming=args.key_naming, overwrite=args.overwrite, quiet=args.quiet,
                      workers=args.workers, group=getattr(args, "group", None),
                      megatron_version=args.megatron_version, integrity=args.verify_integrity)


def _inspect(args: argparse.Namespace) -> int:
    from checkpoint.opened import open_checkpoint
    from checkpoint.progress import json_text

    ck = open_checkpoint(args.ckpt, args.hf_config, args.vocab_size)
    if ck.format == "torch_dist":
        from checkpoint.errors import ConfigError
        from checkpoint.progress import print_torch_dist_description
        from checkpoint.torch_dist_view import describe_torch_dist

        try:
            d = describe_torch_dist(ck.td, ck.config, ck.config_origin)
        except ConfigError as e:
            if args.hf_config is not None or args.vocab_size is not None:
                raise  # what was given contradicts the checkpoint
            d = describe_torch_dist(ck.td, None, None, str(e))  # nothing describes the model: shown, not fatal
        if args.json:
            print(json_text(d))
        else:
            print_torch_dist_description(d)
        return 0
    from checkpoint.reader import describe

    d = describe(ck.ckpt)
    if args.json:
        print(json_text(d))
        return 0
    from checkpoint.progress import print_description

    print_description(d)
    return 0


def _verify(args: argparse.Namespace) -> int:
    """verify, either format (verify/run.py): one report, one verdict."""
    from plan.units import parse_bytes
    from train.flagcheck import check_tolerance
    from verify.run import verify_checkpoint

    check_tolerance(args.tolerance)  # NaN, inf (which would pass any model) and negatives: one line (issue 34)
    budget = None if args.memory_budget is None else parse_bytes(args.memory_budget, "--memory-budget")
    return verify_checkpoint(args.ckpt, against=args.against, hf_config=args.hf_config,
                             vocab_size=getattr(args, "vocab_size", None), seq_length=args.seq_length,
                             tolerance=args.tolerance, streaming=args.streaming, memory_budget=budget,
                             all_experts=args.all_experts, quiet=args.quiet, as_json=args.json)


if __name__ == "__main__":
    sys.exit(main())
