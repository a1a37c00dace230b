"""manifest.json: the written-down contract of one checkpoint iteration (see docs/FORMAT.md).

Strict on read: unknown format or version, tensor names that are not dotted identifiers, paths that leave the
iteration directory, or a digest that does not match are all errors.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from .config import ModelConfig
from .errors import ConfigError, FormatError, LayoutError
from .layout import Layout
from .megatron import iter_dirname, iteration_of
from .sharding import OPTIMIZER_PREFIX, OPTIMIZER_STATES, TensorSpec, chunk_shape, fp8_scale_specs, optimizer_specs
from .families import model_specs

FORMAT_NAME = "shardkit"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
# Scalar training state (iteration, optimizer step and param groups, scheduler, RNG, data position...), written by the
# trainer as JSON beside the manifest; shardkit carries it verbatim (reshard, torch_dist) and never interprets it.
TRAIN_STATE = "train_state.json"
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*$")
MAX_DIM = 1 << 40  # no axis of any tensor is longer; larger sizes in a manifest are damage or hostile


def valid_iter_dirname(name: str) -> bool:
    """An iteration directory name (Megatron-LM's, checkpoint.megatron.iter_dirname)."""
    return iteration_of(name) is not None


def tensor_path(name: str) -> str:
    """Relative path of a tensor's array inside the iteration directory: `model/<name>`, or `optim/<name>` for
    optimizer state (`optimizer.state.*`)."""
    if not _NAME_RE.match(name):
        raise FormatError(f"tensor name {name!r} is not a dotted identifier; refusing it as a path")
    return f"optim/{name}" if name.startswith(OPTIMIZER_PREFIX) else f"model/{name}"


@dataclass
class TensorEntry:
    shape: list[int]
    dtype: str
    chunk: list[int]
    rule: str
    per_layer: bool
    expert: bool = False
    # crc32c of every chunk file, in C order over the chunk grid (recorded at commit from the files' trailers): a
    # chunk file in the wrong position is found. None in manifests written before they were recorded.
    crc32c: list[int] | None = None

    def __post_init__(self) -> None:
        """A manifest entry is input: its sizes are bounded and typed before any array is opened or chunk iterated."""
        from .sharding import Rule
        from .store import NP_DTYPES

        def dims(v, low: int) -> bool:
            return isinstance(v, list) and 0 < len(v) <= 8 and all(
                isinstance(x, int) and not isinstance(x, bool) and low <= x <= MAX_DIM for x in v)

        if not dims(self.shape, 0) or not dims(self.chunk, 1) or len(self.chunk) != len(self.shape):
            raise FormatError(f"shape {self.shape!r} / chunk {self.chunk!r} are not lists of sizes (<= {MAX_DIM}) of "
                              "one rank")
        if self.dtype not in NP_DTYPES:
            raise FormatError(f"dtype {self.dtype!r} is not one of {', '.join(NP_DTYPES)}")
        if self.rule not in {r.value for r in Rule}:
            raise FormatError(f"rule {self.rule!r} is unknown")
        if not isinstance(self.per_layer, bool) or not isinstance(self.expert, bool):
            raise FormatError("per_layer / expert must be booleans")
        if self.crc32c is not None:
            n = 1
            for s, c in zip(self.shape, self.chunk):
                n *= -(-s // c)
            if not isinstance(self.crc32c, list) or len(self.crc32c) != n or not all(
                    isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 32 for x in self.crc32c):
                raise FormatError(f"crc32c must list one 32-bit checksum per chunk ({n} chunks)")

    def to_dict(self) -> dict:
        """The manifest's JSON of this entry (`crc32c` only when recorded, so older manifests read as they were)."""
        d = dict(vars(self))
        if d["crc32c"] is None:
            del d["crc32c"]
        return d

    @property
    def lead(self) -> int:
        """Leading layer/expert axes before the tensor's own axes."""
        return int(self.per_layer) + int(self.expert)

    @classmethod
    def of(cls, spec: TensorSpec, layout: Layout, dtype: str) -> "TensorEntry":
        from .store import itemsize

        chunk = chunk_shape(spec, layout, itemsize(dtype))
        return cls(list(spec.shape), dtype, list(chunk), spec.rule.value, spec.per_layer, spec.expert)


@dataclass
class Manifest:
    iteration: int
    model: ModelConfig
    layout: Layout
    tensors: dict[str, TensorEntry]
    provenance: dict = field(default_factory=dict)
    training: dict | None = None
    fp8: dict | None = None  # {"block": [br, bc], "tensors": [canonical names kept as e4m3 with <name>_scale_inv]}
    # optimizer states present (a subset of sharding.OPTIMIZER_STATES, in that order): each model tensor <name> then
    # has fp32 arrays optimizer.state.<state>.<name> with the same shape and rule. None: a weights-only checkpoint.
    optimizer: list[str] | None = None
    format: str = FORMAT_NAME
    format_version: int = FORMAT_VERSION

    def __post_init__(self) -> None:
        try:
            self.optimizer = _optimizer_states(self.optimizer)
        except ValueError as e:
            raise FormatError(f"manifest: {e}") from None

    @property
    def vocab(self) -> dict:
        return {"size": self.model.vocab_size, "padded_size": self.model.padded_vocab_size(self.layout.tp),
                "divisible_by": self.model.make_vocab_size_divisible_by}

    def body(self) -> dict:
        return {
            "format": self.format,
            "format_version": self.format_version,
            "iteration": self.iteration,
            "model": self.model.to_dict(),
            "layout": self.layout.to_dict(),
            "vocab": self.vocab,
            "tensors": {k: v.to_dict() for k, v in self.tensors.items()},
            "provenance": self.provenance,
            "training": self.training,
            "fp8": self.fp8,
            # only when present, so weights-only manifests (and their digests) stay as they were
            **({"optimizer": list(self.optimizer)} if self.optimizer else {}),
        }

    def to_json(self) -> str:
        body = self.body()
        body["digest"] = "sha256:" + _digest(body)
        return json.dumps(body, indent=1, sort_keys=False) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = MANIFEST) -> "Manifest":
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # (nested too deeply: issue 34)
            raise FormatError(f"{source}: not valid JSON ({e}); the checkpoint is damaged") from None
        if not isinstance(d, dict):
            raise FormatError(f"{source}: expected a JSON object")
        if d.get("format") != FORMAT_NAME:
            raise FormatError(f"{source}: format {d.get('format')!r} is not {FORMAT_NAME!r}")
        if d.get("format_version") != FORMAT_VERSION:
            raise FormatError(f"{source}: format_version {d.get('format_version')!r} is not supported "
                              f"(this shardkit reads {FORMAT_VERSION})")
        digest = d.pop("digest", None)
        if digest != "sha256:" + _digest(d):
            raise FormatError(f"{source}: digest mismatch; the manifest was edited or damaged")
        try:
            tensors = {}
            for name, e in d["tensors"].items():
                tensor_path(name)
                try:
                    tensors[name] = TensorEntry(**e)
                except FormatError as err:
                    raise FormatError(f"tensor {name}: {err}") from None
            m = cls(iteration=int(d["iteration"]), model=ModelConfig.from_dict(d["model"]),
                    layout=Layout.from_dict(d["layout"]), tensors=tensors, provenance=d.get("provenance") or {},
                    training=d.get("training"), fp8=d.get("fp8"), optimizer=d.get("optimizer"))
        except (FormatError, ConfigError, LayoutError) as e:
            raise FormatError(f"{source}: {str(e).removeprefix('manifest: ')}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise FormatError(f"{source}: malformed manifest ({type(e).__name__}: {e})") from None
        return m

    def specs(self) -> list[TensorSpec]:
        """The sharding table's tensors for this checkpoint: the model's, plus kept-FP8 block scales, then the
        optimizer state of every model tensor when the checkpoint carries it."""
        base = model_specs(self.model, self.layout)
        return base + fp8_scale_specs(base, self.fp8) + optimizer_specs(base, self.optimizer or ())

    @classmethod
    def load(cls, iter_dir: Path) -> "Manifest":
        from .safety import read_input, regular_file

        path = Path(iter_dir) / MANIFEST
        if not regular_file(path, missing_ok=True):  # a FIFO or a device: one line naming it, never a hang
            raise FormatError(f"{path}: missing; {iter_dir} is not a complete checkpoint iteration")
        return cls.from_json(read_input(path), source=str(path))


def _optimizer_states(value) -> list[str] | None:
    """The manifest's `optimizer` field: absent/null, or known states in OPTIMIZER_STATES order, each once."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or any(v not in OPTIMIZER_STATES for v in value) \
            or len(set(value)) != len(value):
        raise ValueError(f"optimizer states {value!r} are not a list of distinct states of {list(OPTIMIZER_STATES)}")
    return sorted(value, key=OPTIMIZER_STATES.index) or None


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
