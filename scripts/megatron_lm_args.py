"""Extract Megatron-LM's argument namespace (every argument its parser defines, with its default) into
checkpoint/megatron_lm_args.py, the data checkpoint.megatron.megatron_args writes into torch_dist common.pt.

    python scripts/megatron_lm_args.py MEGATRON_LM_GIT_DIR [--ref core_v0.16.1] [--out checkpoint/megatron_lm_args.py]

MEGATRON_LM_GIT_DIR is a clone of https://github.com/NVIDIA/Megatron-LM (a bare one will do). `megatron/training` of
`--ref` (the Megatron-LM release of the megatron-core version installed here: its tag `core_v<version>`) is taken
with `git archive` into a temporary directory and its `add_megatron_arguments` run against the installed
megatron-core (several argument groups are generated from megatron-core's own dataclasses, TransformerConfig among
them, so the two must match), then `parse_args([])` of that parser, plus the two attributes Megatron-LM's
`parse_args()` adds from the environment (`rank`, `world_size`, with RANK / WORLD_SIZE / LOCAL_RANK unset). Nothing
of megatron/training's package import runs: `megatron.training` is an empty package pointing at the extracted
directory, and `megatron.training.utils` (which pulls in the trainer) a stub of the four helpers arguments.py imports
from it, none of which the parser calls.

Enum defaults are written as {"enum": "<module>.<Class>", "member": name, "value": value}. Run once per megatron-core
upgrade; the output is committed.
"""
from __future__ import annotations

import argparse
import enum
import importlib.metadata
import os
import pprint
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARGUMENTS = "megatron/training/arguments.py"


def extract(git_dir: str, ref: str) -> tuple[dict, dict, dict]:
    commit = subprocess.run(["git", "-C", git_dir, "rev-parse", f"{ref}^{{commit}}"], check=True, capture_output=True,
                            text=True).stdout.strip()
    blob = subprocess.run(["git", "-C", git_dir, "rev-parse", f"{commit}:{ARGUMENTS}"], check=True,
                          capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "training.tar"
        subprocess.run(["git", "-C", git_dir, "archive", "-o", str(archive), commit, "megatron/training"], check=True)
        with tarfile.open(archive) as t:
            t.extractall(tmp, filter="data")
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            os.environ.pop(var, None)
        import megatron.core  # noqa: F401  (the installed megatron-core; `megatron` is a namespace package)

        pkg = types.ModuleType("megatron.training")
        pkg.__path__ = [str(Path(tmp) / "megatron" / "training")]
        sys.modules["megatron.training"] = pkg
        utils = types.ModuleType("megatron.training.utils")
        for name in ("get_device_arch_version", "update_use_dist_ckpt", "print_rank_0", "warn_rank_0", "is_rank0"):
            setattr(utils, name, lambda *a, **k: None)
        sys.modules["megatron.training.utils"] = utils
        from megatron.training.arguments import add_megatron_arguments

        parser = add_megatron_arguments(argparse.ArgumentParser(description="Megatron-LM Arguments",
                                                                allow_abbrev=False))
        ns = parser.parse_args([])
        options = _options(parser)
    ns.rank, ns.world_size = 0, 1  # parse_args(): int(os.getenv("RANK", "0")), int(os.getenv("WORLD_SIZE", "1"))
    defaults = {k: _plain(k, v) for k, v in vars(ns).items()}
    source = {"repository": "https://github.com/NVIDIA/Megatron-LM", "ref": ref, "commit": commit,
              "file": ARGUMENTS, "blob": blob, "megatron_core": importlib.metadata.version("megatron-core"),
              "arguments": len(defaults)}
    return source, defaults, options


def _options(parser: argparse.ArgumentParser) -> dict:
    """Every option string -> [dest, nargs, type, const]: nargs 0 for a flag without a value (store_true/false/const:
    then const is the value it stores), else argparse's nargs (None: one value); type int, float or str (what the
    value is parsed as; str for anything else)."""
    out = {}
    for act in parser._actions:
        if not act.option_strings or act.dest == "help":
            continue
        takes = act.nargs != 0 and not isinstance(act, (argparse._StoreConstAction, argparse._CountAction))
        typ = act.type if act.type in (int, float, str) else "str"
        typ = typ.__name__ if isinstance(typ, type) else typ
        const = _plain(act.dest, act.const) if not takes else None
        for opt in act.option_strings:
            out[opt] = [act.dest, act.nargs if takes else 0, typ, const]
    return out


def _plain(name: str, v):
    if isinstance(v, enum.Enum):
        return {"enum": f"{type(v).__module__}.{type(v).__qualname__}", "member": v.name, "value": v.value}
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)) and all(x is None or isinstance(x, (bool, int, float, str)) for x in v):
        return list(v)
    raise TypeError(f"argument {name}: default {v!r} ({type(v).__name__}) has no plain-data form")


HEADER = '''"""Megatron-LM's argument namespace: every argument megatron/training/arguments.py defines, with its default.

GENERATED by scripts/megatron_lm_args.py from the source below; do not edit by hand (rerun it for another
megatron-core release). Data only: checkpoint/megatron.py (megatron_args) starts every common.pt `args` from these
defaults and sets what the model and layout decide; train/config.py (megatron_flags) knows every Megatron-LM flag
of continue-pretrain's command line from OPTIONS. Enum defaults are {{"enum": "<module>.<Class>", "member", "value"}}.
"""

SOURCE = {source}

DEFAULTS = {defaults}

# every option string of that parser -> [dest, nargs (0: no value), value type, const stored by a no-value flag]
OPTIONS = {options}
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("git_dir", help="a clone of NVIDIA/Megatron-LM")
    ap.add_argument("--ref", default=None,
                    help="tag or commit (default: core_v<installed megatron-core version>)")
    ap.add_argument("--out", default=str(ROOT / "checkpoint" / "megatron_lm_args.py"))
    a = ap.parse_args()
    ref = a.ref or f"core_v{importlib.metadata.version('megatron-core')}"
    source, defaults, options = extract(a.git_dir, ref)
    text = HEADER.format(source=pprint.pformat(source, width=116, sort_dicts=False),
                         defaults=pprint.pformat(defaults, width=116, sort_dicts=False),
                         options=pprint.pformat(options, width=116, sort_dicts=False))
    Path(a.out).write_text(text)
    print(f"wrote {a.out}: {len(defaults)} arguments from Megatron-LM {ref} ({source['commit'][:12]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
