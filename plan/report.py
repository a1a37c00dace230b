"""Show a plan: a ranked rich table, JSON, and a PNG bar chart of the memory breakdown of the top layouts."""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from checkpoint.errors import WriteError

from .memory import TrainSettings
from .perf import Hardware
from .search import Candidate
from .units import GiB

COMPONENTS = ("weights", "grads", "optimizer", "activations", "comm_buffers", "fp8_weights", "reserved")

# a violation message -> the constraint's short name (for the summary of skipped layouts)
_KINDS = [(r"num_attention_heads", "heads % tp"), (r"KV heads", "kv groups % tp"), (r"intermediate_size", "ffn % tp"),
          (r"shared-expert", "shared ffn % tp"), (r"expert ffn", "expert ffn % etp"),
          (r"number of experts", "experts % ep"), (r"exceed num_hidden_layers", "pp x vpp > layers"),
          (r"num_hidden_layers", "layers % (pp x vpp)"), (r"seq-length", "seq % 2cp"),
          (r"global-batch-size", "batch % (mbs x dp)"), (r"etp x ep", "etp x ep vs stage ranks"),
          (r"inside a node", "tp > gpus per node"), (r"--gpus", "world size")]


def number(v: float, decimals: int) -> str:
    """`decimals` places, but small values keep two significant digits: a tiny model's step is 0.0031 s, not
    0.00 (which reads as free, or as broken)."""
    if v == 0 or abs(v) >= 10 ** -decimals * 10:
        return f"{v:.{decimals}f}"
    return f"{v:.2g}"


def constraint_name(message: str) -> str:
    for pattern, name in _KINDS:
        if re.search(pattern, message):
            return name
    return message


def to_json(cands: list[Candidate], cfg_name: str, gpus: int, gpu_memory: int, s: TrainSettings,
            hw: Hardware, limit: int | None = None) -> dict:
    shown = cands if limit is None else cands[:limit]
    return {"model": cfg_name, "gpus": gpus, "gpu_memory_bytes": gpu_memory, "settings": _settings(s),
            "hardware": hw.to_dict(), "candidates": len(cands), "fitting": sum(c.fits for c in cands),
            "invalid": sum(not c.valid for c in cands), "layouts": [c.to_dict() for c in shown]}


def _settings(s: TrainSettings) -> dict:
    from dataclasses import asdict

    return asdict(s)


def launch_argv(c: Candidate, gpus: int, gpus_per_node: int, load: str | None = None) -> list[str]:
    """The `shardkit launch` command that runs candidate `c` as planned: its layout (and pipeline split), recompute,
    engine, nodes, and after `--` what the estimate assumes: the layer spec it modeled (--transformer-impl), the
    sequence, batch sizes, bf16, no dropout, and for a plan of a checkpoint --load. --data-path and --save are the
    user's to add."""
    from .search import layout_arg

    s = c.settings
    argv = ["shardkit", "launch", "--layout", layout_arg(c.layout), "--nodes", str(max(1, gpus // gpus_per_node)),
            "--gpus-per-node", str(min(gpus, gpus_per_node)), "--recompute", s.recompute, "--engine", s.engine, "--",
            "--seq-length", str(s.seq_length), "--micro-batch-size", str(s.micro_batch_size),
            "--global-batch-size", str(s.global_batch_size)]
    if s.transformer_impl:  # the layer spec whose activations were modeled (search.layer_spec), not the node's default
        argv += ["--transformer-impl", s.transformer_impl]
    if s.engine == "megatron-core":  # the DP overlap the step time assumed (the native engine has none)
        argv += ["--overlap-grad-reduce"] if s.overlap_grad_reduce else []
        argv += ["--overlap-param-gather"] if s.overlap_param_gather and s.distributed_optimizer else []
    if s.params_dtype in ("bfloat16", "bf16"):
        argv.append("--bf16")
    # no dropout, as the estimate counts no dropout masks and as these models were trained (Megatron's default 0.1
    # would also refuse context parallelism, whose attention applies none)
    argv += ["--attention-dropout", "0", "--hidden-dropout", "0"]
    if s.fp8:
        argv += ["--fp8-format", s.fp8_format]
        argv += ["--fp8-recipe", s.fp8_recipe] if s.fp8_recipe != "delayed" else []
        argv += ["--no-fp8-wgrad"] if not s.fp8_wgrad else []
        argv += ["--first-last-layers-bf16"] if s.first_last_layers_bf16 else []
    if load:
        argv += ["--load", load]
    return argv


def stage_memory_line(c: Candidate) -> str:
    """Each pipeline stage's GiB per GPU and decoder layers, the heaviest (the one that decides "fits") marked."""
    m, layers = c.memory, c.stage_layers
    parts = [f"{'*' if r == m.pp_rank else ''}{r}: {number(t / GiB, 1)} ({n})" for r, (t, n) in
             enumerate(zip(m.stages, layers))]
    return (f"{c.layout.label()} [{c.settings.recompute}] per stage, GiB (decoder layers): {' | '.join(parts)}; "
            f"heaviest: stage {m.pp_rank} ({number(m.total / GiB, 1)} GiB)")


_RECOMPUTE = {"none": "none", "selective": "sel", "full": "full"}
TABLE_WIDTH = 120  # the table's columns fit this many; the reasons go below it, one line each


def wrap(text: str, width: int = TABLE_WIDTH) -> str:
    """A detail line below the table: wrapped at `width`, continuation lines indented."""
    import textwrap

    return textwrap.fill(text, width, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False)


def shell_command(argv: list[str], width: int = TABLE_WIDTH) -> str:
    """A command for people to copy: quoted, broken into lines of at most `width` with backslash continuations."""
    import shlex

    groups: list[str] = []  # a flag with its values stays on one line
    for word in argv:
        if word.startswith("-") or not groups or not groups[-1].startswith("-"):
            groups.append(shlex.quote(word))
        else:
            groups[-1] += " " + shlex.quote(word)
    lines, cur = [], ""
    for word in groups:
        if cur and len(cur) + 1 + len(word) > width - 2:
            lines.append(cur)
            cur = "    " + word
        else:
            cur = f"{cur} {word}" if cur else word
    return " \\\n".join(lines + [cur])


def print_table(cands: list[Candidate], title: str, gpu_memory: int, top: int = 10,
                requested: list[Candidate] | None = None, chosen: Candidate | None = None) -> None:
    """The ranked layouts as a table that fits 120 columns (memory by component in GiB, what is left free, step time,
    throughput, MFU, a one-word note) and, below it, what each note stands for: why a layout does not fit or breaks
    a constraint, why an unusual layout ranks first, the per-stage memory of a layout asked for."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if not con.is_terminal:  # piped or captured: the table's own width, not 80 columns
        con = Console(width=TABLE_WIDTH)
    fitting = [c for c in cands if c.fits]
    valid_misfit = [c for c in cands if c.valid and not c.fits]
    rows = (requested or []) + (fitting[:top] if fitting else valid_misfit[:top])
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for col in ("#", "layout", "mbs", "rec", "wts", "grad", "opt", "act", "GiB", "free", "step s", "tok/s", "MFU",
                "note"):
        t.add_column(col, justify="left" if col in ("layout", "rec", "note") else "right",
                     no_wrap=col != "layout", overflow="fold")
    details: list[str] = []
    for i, c in enumerate(rows):
        m = c.memory
        tag = f"r{i + 1}" if requested and i < len(requested) else str(cands.index(c) + 1)
        if not c.valid:
            note, style = "invalid", "red"
        elif not c.fits:
            note, style = "no fit", "yellow"
        else:
            note, style = ("unusual" if c.unusual else "fits"), None
        if not c.fits:
            details.append(f"{tag}: {c.reason}")
        elif c.why:
            details.append(f"{tag}: {c.why}")
        elif c.unusual:
            details.append(f"{tag}: unusual: {'; '.join(c.unusual)}")
        if c.engine_note and c.valid:  # modelled on the native engine where megatron-core was the default
            details.append(f"{tag}: {c.engine_note}")
        if tag.startswith("r") and c.layout.pp > 1:  # a layout asked for: every stage, not only the heaviest
            details.append(f"{tag}: {stage_memory_line(c)}")
        t.add_row(tag, c.layout.label(), str(c.settings.micro_batch_size), _RECOMPUTE[c.settings.recompute],
                  *(number(x / GiB, 1) for x in (m.weights, m.grads, m.optimizer, m.activations, m.total)),
                  number(c.free / GiB, 1), number(c.perf['step_s'], 2), f"{c.perf['tokens_per_s_per_gpu']:,.0f}",
                  f"{100 * c.perf['mfu']:.1f}%", note, style=style)
    out = con.file

    def line(text: str) -> None:  # plain text wrapped at the table's width (never into 80 columns)
        out.write(wrap(text) + "\n")

    line(title)
    con.print(t)

    line("GiB per GPU on the heaviest pipeline stage (weights, grads, optimizer, activations, communication buffers, "
         "reserved); free: what is left of the GPU; rec: activation recompute; tok/s: tokens/s per GPU")
    for d in details:
        line(d)
    invalid = [c for c in cands if not c.valid]
    if invalid:
        kinds = Counter(constraint_name(v) for c in invalid for v in c.violations)
        line(f"{len(invalid)} layout(s) break a constraint: " +
             ", ".join(f"{k} ({n})" for k, n in kinds.most_common()))
    if not valid_misfit and not fitting:
        line("no layout satisfies the constraints (see the notes above)")
    elif not fitting:
        best = min(valid_misfit, key=lambda c: c.memory.total)
        line(f"nothing fits in {gpu_memory / GiB:.1f} GiB per GPU with {best.headroom / GiB:.1f} GiB headroom; the "
             f"smallest is {best.layout.label()} (recompute {best.settings.recompute}) at "
             f"{best.memory.total / GiB:.1f} GiB")
    else:
        b = fitting[0]
        line(f"plan's choice: {b.layout.label()}, micro batch {b.settings.micro_batch_size}, recompute "
             f"{b.settings.recompute}, engine {b.settings.engine} ({b.settings.transformer_impl} layer spec, "
             f"{b.settings.layer_kernels} kernels): "
             f"{number(b.memory.total / GiB, 1)} GiB per GPU "
             f"({number(b.free / GiB, 1)} free), {number(b.perf['step_s'], 2)} s/step, MFU {100 * b.perf['mfu']:.1f}%")
        if b.engine_note:
            line(f"its engine: {b.engine_note}")
    if chosen is not None and chosen is not (fitting[0] if fitting else None):
        line(f"the command below runs the layout asked for that fits: {chosen.layout.label()}, micro batch "
             f"{chosen.settings.micro_batch_size}, recompute {chosen.settings.recompute}")


def plot(cands: list[Candidate], path: str, gpu_memory: int, title: str, top: int = 8) -> Path:
    """Stacked horizontal bars of the memory components of the first `top` layouts, the GPU memory as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = cands[:top]
    if not shown:
        raise WriteError(f"--plot {path}: no layout to plot")
    staged = next((c for c in shown if c.layout.pp > 1), None)  # its stages in a panel of their own
    if staged is None:
        fig, ax = plt.subplots(figsize=(12, 1.2 + 0.5 * len(shown)))
    else:
        fig, (ax, sx) = plt.subplots(2, 1, figsize=(12, 4.2 + 0.5 * len(shown)),
                                     gridspec_kw={"height_ratios": [1 + 0.5 * len(shown), 3]})
        stage_panel(sx, staged, gpu_memory)

    def label(c: Candidate) -> str:  # an invalid or non-fitting layout is never drawn as if it could run
        text = f"{c.layout.label()} [{c.settings.recompute}]"
        if c.layout.pp > 1:
            text += f" (stage {c.memory.pp_rank})"
        if not c.valid:
            return f"{text}  INVALID: {', '.join(dict.fromkeys(constraint_name(v) for v in c.violations))}"
        return text if c.fits else f"{text}  does not fit"

    labels = [label(c) for c in shown][::-1]
    left = [0.0] * len(shown)
    for comp in COMPONENTS:
        vals = [c.memory.breakdown()[comp] / GiB for c in shown][::-1]
        if not any(vals):
            continue
        bars = ax.barh(labels, vals, left=left, label=comp.replace("_", " "))
        for bar, c in zip(bars, shown[::-1]):
            if not c.valid:
                bar.set_alpha(0.35)
                bar.set_hatch("//")
        left = [a + b for a, b in zip(left, vals)]
    for tick, c in zip(ax.get_yticklabels(), shown[::-1]):
        if not c.fits:
            tick.set_color("red" if not c.valid else "darkorange")
    ax.axvline(gpu_memory / GiB, color="black", linestyle="--", label=f"GPU memory {gpu_memory / GiB:.0f} GiB")
    ax.set_xlabel("GiB per GPU (heaviest pipeline stage, named after each layout)")
    ax.set_title(title, fontsize="small")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.tight_layout()
    import os

    from checkpoint.safety import check_target

    out = Path(path)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        check_target(out, "--plot", ours=True)  # a link or a non-regular file there is never written through
        check_target(tmp, "--plot", ours=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(tmp, dpi=110, format=out.suffix.lstrip(".") or "png")
        os.replace(tmp, out)
    except OSError as e:
        if tmp.is_file() and not tmp.is_symlink():
            tmp.unlink()
        raise WriteError(f"--plot {path}: cannot write ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    return out


def stage_panel(ax, c: Candidate, gpu_memory: int) -> list:
    """Bars of each pipeline stage's GiB per GPU for one layout, labelled with its decoder layers; the heaviest stage
    (the one that decides whether the layout fits) drawn in red and annotated. Returns the bars."""
    totals = [t / GiB for t in c.memory.stages]
    heavy = c.memory.pp_rank
    bars = ax.bar([f"{r}\n{n}L" for r, n in enumerate(c.stage_layers)], totals,
                  color=["tab:red" if r == heavy else "tab:blue" for r in range(len(totals))])
    ax.annotate(f"heaviest: stage {heavy}, {totals[heavy]:.1f} GiB", (heavy, totals[heavy]),
                xytext=(0, 4), textcoords="offset points", ha="center", fontsize="small", color="tab:red")
    ax.axhline(gpu_memory / GiB, color="black", linestyle="--")
    ax.set_ylabel("GiB per GPU")
    ax.set_xlabel("pipeline stage (decoder layers)")
    ax.set_title(f"{c.layout.label()} [{c.settings.recompute}]: memory per pipeline stage", fontsize="small")
    return list(bars)
