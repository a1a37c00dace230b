"""Training checkpoints' parameter table: every local parameter must have the shape the sharding table gives it."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from checkpoint.config import ModelConfig
from checkpoint.errors import FormatError
from checkpoint.layout import Layout
from train.checkpointing import param_table
from train.model import GPTModel

CFG = ModelConfig(model_type="llama", num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                  num_query_groups=2, kv_channels=16, vocab_size=256, max_position_embeddings=64, norm_epsilon=1e-5, rotary_base=1e4)
RANK0 = SimpleNamespace(pp_rank=0, first_stage=True)  # the one rank of tp=pp=1


def test_matching_parameters_pass():
    model = GPTModel(CFG, CFG.padded_vocab_size(1))
    table = param_table(model, CFG, Layout(), RANK0)
    assert len(table) == len(list(model.parameters()))


def test_a_wrong_shaped_local_parameter_is_refused():
    model = GPTModel(CFG, CFG.padded_vocab_size(1))
    layer = model.decoder.layers["1"].mlp.linear_fc2
    layer.weight = torch.nn.Parameter(torch.zeros(64, 1))  # would broadcast in copy_ when loading
    with pytest.raises(FormatError, match=r"^parameter decoder\.layers\.1\.mlp\.linear_fc2\.weight: local shape "
                                          r"\[64, 1\].*\[64, 128\]"):
        param_table(model, CFG, Layout(), RANK0)
