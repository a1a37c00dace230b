"""The model-parallel layout a checkpoint is sharded for (TP x PP x VPP, EP x ETP) and the checks that it fits a model.
Pure functions, no process groups. A whole training run's layout (adding CP and DP) is checkpoint.run_layout.RunLayout,
whose `model_parallel` is this one."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Iterator

from .config import ModelConfig
from .errors import LayoutError

MAX_PARALLEL = 1 << 16  # no parallel dimension is larger (a manifest or a flag saying so is refused)


@dataclass(frozen=True)
class RankCoord:
    """A rank's coordinates in the dimensions that split tensors. Dense tensors use (tp, pp); expert tensors use
    (ep, etp, pp): Megatron lays the expert groups over the same ranks, so one physical rank has both."""

    tp: int = 0
    pp: int = 0
    ep: int = 0
    etp: int = 0


@dataclass(frozen=True)
class Layout:
    """Model-parallel layout. Data parallel replicas hold identical shards and do not appear here."""

    tp: int = 1
    pp: int = 1
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    ep: int = 1  # expert parallel: splits the expert axis
    etp: int | None = None  # expert tensor parallel; None = same as tp (Megatron's default)

    def __post_init__(self) -> None:
        for flag, v in (("--tp", self.tp), ("--pp", self.pp), ("--vpp", self.vpp), ("--ep", self.ep),
                        ("--etp", self.etp if self.etp is not None else 1)):
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_PARALLEL:
                raise LayoutError(f"{flag} must be a positive integer up to {MAX_PARALLEL}, got {v!r}")

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def ranks(self, expert: bool = False) -> Iterator[RankCoord]:
        """The distinct shard coordinates: (tp, pp) for dense tensors, (ep, etp, pp) for expert tensors."""
        for pp in range(self.pp):
            if expert:
                for ep in range(self.ep):
                    for etp in range(self.expert_tp):
                        yield RankCoord(pp=pp, ep=ep, etp=etp)
            else:
                for tp in range(self.tp):
                    yield RankCoord(tp=tp, pp=pp)

    def check(self, cfg: ModelConfig) -> None:
        """Raise LayoutError naming the flag and the model field when the layout cannot hold the model."""
        tp = self.tp
        if cfg.num_attention_heads % tp:
            raise LayoutError(f"--tp {tp} does not divide num_attention_heads={cfg.num_attention_heads}")
        if cfg.num_query_groups % tp:
            raise LayoutError(f"--tp {tp} does not divide the KV heads (num_key_value_heads={cfg.num_query_groups}); "
                              "Megatron gives each TP rank whole query groups")
        has_dense_mlp = not cfg.is_moe or 0 in cfg.moe_layer_freq
        if has_dense_mlp and cfg.ffn_hidden_size % tp:
            raise LayoutError(f"--tp {tp} does not divide intermediate_size={cfg.ffn_hidden_size}")
        if cfg.is_moe:
            if cfg.num_moe_experts % self.ep:
                raise LayoutError(f"--ep {self.ep} does not divide the number of experts ({cfg.num_moe_experts})")
            if cfg.moe_ffn_hidden_size % self.expert_tp:
                raise LayoutError(f"--etp {self.expert_tp} does not divide the expert ffn size "
                                  f"({cfg.moe_ffn_hidden_size})")
            shared = cfg.moe_shared_expert_intermediate_size
            if shared and shared % tp:
                raise LayoutError(f"--tp {tp} does not divide the shared-expert ffn size ({shared})")
        elif self.ep > 1 or self.etp not in (None, 1):
            raise LayoutError(f"--ep/--etp apply to MoE models only; {cfg.model_type} has no experts")
        stages = self.pp * self.vpp
        if stages > cfg.num_layers:
            raise LayoutError(f"--pp {self.pp} x --vpp {self.vpp} = {stages} pipeline stages exceed "
                              f"num_hidden_layers={cfg.num_layers}")
        if cfg.num_layers % stages:
            raise LayoutError(f"num_hidden_layers={cfg.num_layers} is not divisible by --pp {self.pp} x --vpp "
                              f"{self.vpp} = {stages}")

    def layers_per_chunk(self, num_layers: int) -> int:
        return num_layers // (self.pp * self.vpp)

    def layer_range(self, num_layers: int, pp_rank: int, vstage: int) -> tuple[int, int]:
        """Global layers [start, stop) of model chunk `vstage` on pipeline rank `pp_rank` (Megatron's interleaving:
        chunk c = vstage * pp + pp_rank)."""
        n = self.layers_per_chunk(num_layers)
        c = vstage * self.pp + pp_rank
        return c * n, (c + 1) * n

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        etp = d.get("etp")
        return cls(tp=int(d["tp"]), pp=int(d["pp"]), vpp=int(d.get("vpp", 1)), ep=int(d.get("ep", 1)),
                   etp=None if etp is None else int(etp))
