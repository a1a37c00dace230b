"""Named presets: the published HF ``config.json`` of well-known models, so a plan or a run can name a model
(``--model llama3-70b``) without downloading it.

Each dict is the hub file itself, copied from the vendored copies in ``shared/hf-configs/`` (see SOURCES.md there for
where each came from; tests/test_plan.py and tests/test_qwen3.py check they are still equal), except llama2-13b,
qwen3-32b and qwen3-235b-a22b, which have no copy there and are transcribed from the source named beside each. They go
through ``ModelConfig.from_hf`` like any other config, so the planner and the trainer see exactly what a converted
checkpoint of that model would record.
"""
from __future__ import annotations

import copy

from .config import ModelConfig
from .errors import ConfigError

PRESETS: dict[str, dict] = {
    # shared/hf-configs/meta-llama--Llama-2-7b-hf.json (verbatim)
    'llama2-7b': {'_name_or_path': 'meta-llama/Llama-2-7b-hf', 'architectures': ['LlamaForCausalLM'],
      'bos_token_id': 1, 'eos_token_id': 2, 'hidden_act': 'silu', 'hidden_size': 4096, 'initializer_range': 0.02,
      'intermediate_size': 11008, 'max_position_embeddings': 4096, 'model_type': 'llama', 'num_attention_heads': 32,
      'num_hidden_layers': 32, 'num_key_value_heads': 32, 'pretraining_tp': 1, 'rms_norm_eps': 1e-05,
      'rope_scaling': None, 'tie_word_embeddings': False, 'torch_dtype': 'float16',
      'transformers_version': '4.31.0.dev0', 'use_cache': True, 'vocab_size': 32000},
    # Girafboy/pytorchKQI example/evaluate.py (9632690266), variable Llama_2_13b_hf; True/False/None -> JSON
    'llama2-13b': {'_name_or_path': 'meta-llama/Llama-2-13b-hf', 'architectures': ['LlamaForCausalLM'],
      'bos_token_id': 1, 'eos_token_id': 2, 'hidden_act': 'silu', 'hidden_size': 5120, 'initializer_range': 0.02,
      'intermediate_size': 13824, 'max_position_embeddings': 4096, 'model_type': 'llama', 'num_attention_heads': 40,
      'num_hidden_layers': 40, 'num_key_value_heads': 40, 'pretraining_tp': 1, 'rms_norm_eps': 1e-05,
      'rope_scaling': None, 'tie_word_embeddings': False, 'torch_dtype': 'float16',
      'transformers_version': '4.32.0.dev0', 'use_cache': True, 'vocab_size': 32000},
    # shared/hf-configs/meta-llama--Llama-2-70b-hf.json (verbatim)
    'llama2-70b': {'_name_or_path': 'meta-llama/Llama-2-70b-hf', 'architectures': ['LlamaForCausalLM'],
      'bos_token_id': 1, 'eos_token_id': 2, 'hidden_act': 'silu', 'hidden_size': 8192, 'initializer_range': 0.02,
      'intermediate_size': 28672, 'max_position_embeddings': 4096, 'model_type': 'llama', 'num_attention_heads': 64,
      'num_hidden_layers': 80, 'num_key_value_heads': 8, 'pretraining_tp': 1, 'rms_norm_eps': 1e-05,
      'rope_scaling': None, 'tie_word_embeddings': False, 'torch_dtype': 'float16',
      'transformers_version': '4.32.0.dev0', 'use_cache': True, 'vocab_size': 32000},
    # shared/hf-configs/meta-llama--Meta-Llama-3-8B.json (verbatim)
    'llama3-8b': {'architectures': ['LlamaForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'bos_token_id': 128000, 'eos_token_id': 128001, 'hidden_act': 'silu', 'hidden_size': 4096,
      'initializer_range': 0.02, 'intermediate_size': 14336, 'max_position_embeddings': 8192, 'model_type': 'llama',
      'num_attention_heads': 32, 'num_hidden_layers': 32, 'num_key_value_heads': 8, 'pretraining_tp': 1,
      'rms_norm_eps': 1e-05, 'rope_scaling': None, 'rope_theta': 500000.0, 'tie_word_embeddings': False,
      'torch_dtype': 'bfloat16', 'transformers_version': '4.40.0.dev0', 'use_cache': True, 'vocab_size': 128256},
    # shared/hf-configs/meta-llama--Meta-Llama-3-70B.json (verbatim)
    'llama3-70b': {'architectures': ['LlamaForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'bos_token_id': 128000, 'eos_token_id': 128001, 'hidden_act': 'silu', 'hidden_size': 8192,
      'initializer_range': 0.02, 'intermediate_size': 28672, 'max_position_embeddings': 8192, 'model_type': 'llama',
      'num_attention_heads': 64, 'num_hidden_layers': 80, 'num_key_value_heads': 8, 'pretraining_tp': 1,
      'rms_norm_eps': 1e-05, 'rope_scaling': None, 'rope_theta': 500000.0, 'tie_word_embeddings': False,
      'torch_dtype': 'bfloat16', 'transformers_version': '4.40.0.dev0', 'use_cache': True, 'vocab_size': 128256},
    # shared/hf-configs/meta-llama--Llama-3.1-8B.json (verbatim)
    'llama3.1-8b': {'architectures': ['LlamaForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'bos_token_id': 128000, 'eos_token_id': 128001, 'hidden_act': 'silu', 'hidden_size': 4096,
      'initializer_range': 0.02, 'intermediate_size': 14336, 'max_position_embeddings': 131072, 'mlp_bias': False,
      'model_type': 'llama', 'num_attention_heads': 32, 'num_hidden_layers': 32, 'num_key_value_heads': 8,
      'pretraining_tp': 1, 'rms_norm_eps': 1e-05,
      'rope_scaling': {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},
      'rope_theta': 500000.0, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.43.0.dev0', 'use_cache': True, 'vocab_size': 128256},
    # shared/hf-configs/meta-llama--Llama-3.1-405B.json (verbatim)
    'llama3.1-405b': {'architectures': ['LlamaForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'bos_token_id': 128000, 'eos_token_id': 128001, 'hidden_act': 'silu', 'hidden_size': 16384,
      'initializer_range': 0.02, 'intermediate_size': 53248, 'max_position_embeddings': 131072, 'mlp_bias': False,
      'model_type': 'llama', 'num_attention_heads': 128, 'num_hidden_layers': 126, 'num_key_value_heads': 8,
      'pretraining_tp': 1, 'rms_norm_eps': 1e-05,
      'rope_scaling': {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},
      'rope_theta': 500000.0, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.42.3', 'use_cache': True, 'vocab_size': 128256},
    # shared/hf-configs/meta-llama--Llama-3.2-1B.json (verbatim)
    'llama3.2-1b': {'architectures': ['LlamaForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'bos_token_id': 128000, 'eos_token_id': 128001, 'head_dim': 64, 'hidden_act': 'silu', 'hidden_size': 2048,
      'initializer_range': 0.02, 'intermediate_size': 8192, 'max_position_embeddings': 131072, 'mlp_bias': False,
      'model_type': 'llama', 'num_attention_heads': 32, 'num_hidden_layers': 16, 'num_key_value_heads': 8,
      'pretraining_tp': 1, 'rms_norm_eps': 1e-05,
      'rope_scaling': {'factor': 32.0, 'high_freq_factor': 4.0, 'low_freq_factor': 1.0, 'original_max_position_embeddings': 8192, 'rope_type': 'llama3'},
      'rope_theta': 500000.0, 'tie_word_embeddings': True, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.45.0.dev0', 'use_cache': True, 'vocab_size': 128256},
    # shared/hf-configs/mistralai--Mistral-7B-v0.1.json (verbatim)
    'mistral-7b': {'architectures': ['MistralForCausalLM'], 'bos_token_id': 1, 'eos_token_id': 2,
      'hidden_act': 'silu', 'hidden_size': 4096, 'initializer_range': 0.02, 'intermediate_size': 14336,
      'max_position_embeddings': 32768, 'model_type': 'mistral', 'num_attention_heads': 32, 'num_hidden_layers': 32,
      'num_key_value_heads': 8, 'rms_norm_eps': 1e-05, 'rope_theta': 10000.0, 'sliding_window': 4096,
      'tie_word_embeddings': False, 'torch_dtype': 'bfloat16', 'transformers_version': '4.34.0.dev0',
      'use_cache': True, 'vocab_size': 32000},
    # shared/hf-configs/Qwen--Qwen2.5-7B.json (verbatim)
    'qwen2.5-7b': {'architectures': ['Qwen2ForCausalLM'], 'attention_dropout': 0.0, 'bos_token_id': 151643,
      'eos_token_id': 151643, 'hidden_act': 'silu', 'hidden_size': 3584, 'initializer_range': 0.02,
      'intermediate_size': 18944, 'max_position_embeddings': 131072, 'max_window_layers': 28, 'model_type': 'qwen2',
      'num_attention_heads': 28, 'num_hidden_layers': 28, 'num_key_value_heads': 4, 'rms_norm_eps': 1e-06,
      'rope_theta': 1000000.0, 'sliding_window': 131072, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.40.1', 'use_cache': True, 'use_mrope': False, 'use_sliding_window': False,
      'vocab_size': 152064},
    # shared/hf-configs/mistralai--Mixtral-8x7B-v0.1.json (verbatim)
    'mixtral-8x7b': {'architectures': ['MixtralForCausalLM'], 'attention_dropout': 0.0, 'bos_token_id': 1,
      'eos_token_id': 2, 'hidden_act': 'silu', 'hidden_size': 4096, 'initializer_range': 0.02,
      'intermediate_size': 14336, 'max_position_embeddings': 32768, 'model_type': 'mixtral',
      'num_attention_heads': 32, 'num_experts_per_tok': 2, 'num_hidden_layers': 32, 'num_key_value_heads': 8,
      'num_local_experts': 8, 'output_router_logits': False, 'rms_norm_eps': 1e-05, 'rope_theta': 1000000.0,
      'router_aux_loss_coef': 0.02, 'sliding_window': None, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.36.0.dev0', 'use_cache': True, 'vocab_size': 32000},
    # shared/hf-configs/mistralai--Mixtral-8x22B-v0.1.json (verbatim)
    'mixtral-8x22b': {'architectures': ['MixtralForCausalLM'], 'attention_dropout': 0.0, 'bos_token_id': 1,
      'eos_token_id': 2, 'hidden_act': 'silu', 'hidden_size': 6144, 'initializer_range': 0.02,
      'intermediate_size': 16384, 'max_position_embeddings': 65536, 'model_type': 'mixtral',
      'num_attention_heads': 48, 'num_experts_per_tok': 2, 'num_hidden_layers': 56, 'num_key_value_heads': 8,
      'num_local_experts': 8, 'output_router_logits': False, 'rms_norm_eps': 1e-05, 'rope_theta': 1000000,
      'router_aux_loss_coef': 0.001, 'sliding_window': None, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.38.0', 'use_cache': True, 'vocab_size': 32000},
    # shared/hf-configs/deepseek-ai--DeepSeek-V2-Lite.json (verbatim)
    'deepseek-v2-lite': {'architectures': ['DeepseekV2ForCausalLM'], 'attention_bias': False,
      'attention_dropout': 0.0,
      'auto_map': {'AutoConfig': 'configuration_deepseek.DeepseekV2Config', 'AutoModel': 'modeling_deepseek.DeepseekV2Model', 'AutoModelForCausalLM': 'modeling_deepseek.DeepseekV2ForCausalLM'},
      'aux_loss_alpha': 0.001, 'bos_token_id': 100000, 'eos_token_id': 100001, 'first_k_dense_replace': 1,
      'hidden_act': 'silu', 'hidden_size': 2048, 'initializer_range': 0.02, 'intermediate_size': 10944,
      'kv_lora_rank': 512, 'max_position_embeddings': 163840, 'model_type': 'deepseek_v2',
      'moe_intermediate_size': 1408, 'moe_layer_freq': 1, 'n_group': 1, 'n_routed_experts': 64,
      'n_shared_experts': 2, 'norm_topk_prob': False, 'num_attention_heads': 16, 'num_experts_per_tok': 6,
      'num_hidden_layers': 27, 'num_key_value_heads': 16, 'pretraining_tp': 1, 'q_lora_rank': None,
      'qk_nope_head_dim': 128, 'qk_rope_head_dim': 64, 'rms_norm_eps': 1e-06,
      'rope_scaling': {'beta_fast': 32, 'beta_slow': 1, 'factor': 40, 'mscale': 0.707, 'mscale_all_dim': 0.707, 'original_max_position_embeddings': 4096, 'type': 'yarn'},
      'rope_theta': 10000, 'routed_scaling_factor': 1.0, 'scoring_func': 'softmax', 'seq_aux': True,
      'tie_word_embeddings': False, 'topk_group': 1, 'topk_method': 'greedy', 'torch_dtype': 'bfloat16',
      'transformers_version': '4.33.1', 'use_cache': True, 'v_head_dim': 128, 'vocab_size': 102400},
    # shared/hf-configs/deepseek-ai--DeepSeek-V3.json (verbatim)
    'deepseek-v3': {'architectures': ['DeepseekV3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'auto_map': {'AutoConfig': 'configuration_deepseek.DeepseekV3Config', 'AutoModel': 'modeling_deepseek.DeepseekV3Model', 'AutoModelForCausalLM': 'modeling_deepseek.DeepseekV3ForCausalLM'},
      'bos_token_id': 0, 'eos_token_id': 1, 'ep_size': 1, 'first_k_dense_replace': 3, 'hidden_act': 'silu',
      'hidden_size': 7168, 'initializer_range': 0.02, 'intermediate_size': 18432, 'kv_lora_rank': 512,
      'max_position_embeddings': 163840, 'model_type': 'deepseek_v3', 'moe_intermediate_size': 2048,
      'moe_layer_freq': 1, 'n_group': 8, 'n_routed_experts': 256, 'n_shared_experts': 1, 'norm_topk_prob': True,
      'num_attention_heads': 128, 'num_experts_per_tok': 8, 'num_hidden_layers': 61, 'num_key_value_heads': 128,
      'num_nextn_predict_layers': 1, 'q_lora_rank': 1536, 'qk_nope_head_dim': 128, 'qk_rope_head_dim': 64,
      'quantization_config': {'activation_scheme': 'dynamic', 'fmt': 'e4m3', 'quant_method': 'fp8', 'weight_block_size': [128, 128]},
      'rms_norm_eps': 1e-06,
      'rope_scaling': {'beta_fast': 32, 'beta_slow': 1, 'factor': 40, 'mscale': 1.0, 'mscale_all_dim': 1.0, 'original_max_position_embeddings': 4096, 'type': 'yarn'},
      'rope_theta': 10000, 'routed_scaling_factor': 2.5, 'scoring_func': 'sigmoid', 'tie_word_embeddings': False,
      'topk_group': 4, 'topk_method': 'noaux_tc', 'torch_dtype': 'bfloat16', 'transformers_version': '4.33.1',
      'use_cache': True, 'v_head_dim': 128, 'vocab_size': 129280},
    # shared/hf-configs/Qwen--Qwen3-8B.json (verbatim)
    'qwen3-8b': {'architectures': ['Qwen3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'bos_token_id': 151643, 'eos_token_id': 151645, 'head_dim': 128, 'hidden_act': 'silu', 'hidden_size': 4096,
      'initializer_range': 0.02, 'intermediate_size': 12288, 'max_position_embeddings': 40960,
      'max_window_layers': 36, 'model_type': 'qwen3', 'num_attention_heads': 32, 'num_hidden_layers': 36,
      'num_key_value_heads': 8, 'rms_norm_eps': 1e-06, 'rope_scaling': None, 'rope_theta': 1000000,
      'sliding_window': None, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.51.0', 'use_cache': True, 'use_sliding_window': False, 'vocab_size': 151936},
    # transcribed from huggingface.co/Qwen/Qwen3-32B config.json (no vendored copy)
    'qwen3-32b': {'architectures': ['Qwen3ForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'bos_token_id': 151643, 'eos_token_id': 151645, 'head_dim': 128, 'hidden_act': 'silu', 'hidden_size': 5120,
      'initializer_range': 0.02, 'intermediate_size': 25600, 'max_position_embeddings': 40960,
      'max_window_layers': 64, 'model_type': 'qwen3', 'num_attention_heads': 64, 'num_hidden_layers': 64,
      'num_key_value_heads': 8, 'rms_norm_eps': 1e-06, 'rope_scaling': None, 'rope_theta': 1000000,
      'sliding_window': None, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.51.0', 'use_cache': True, 'use_sliding_window': False, 'vocab_size': 151936},
    # shared/hf-configs/Qwen--Qwen3-30B-A3B.json (verbatim)
    'qwen3-30b-a3b': {'architectures': ['Qwen3MoeForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'bos_token_id': 151643, 'decoder_sparse_step': 1, 'eos_token_id': 151645, 'head_dim': 128,
      'hidden_act': 'silu', 'hidden_size': 2048, 'initializer_range': 0.02, 'intermediate_size': 6144,
      'max_position_embeddings': 40960, 'max_window_layers': 48, 'mlp_only_layers': [], 'model_type': 'qwen3_moe',
      'moe_intermediate_size': 768, 'norm_topk_prob': True, 'num_attention_heads': 32, 'num_experts': 128,
      'num_experts_per_tok': 8, 'num_hidden_layers': 48, 'num_key_value_heads': 4, 'output_router_logits': False,
      'rms_norm_eps': 1e-06, 'rope_scaling': None, 'rope_theta': 1000000.0, 'router_aux_loss_coef': 0.001,
      'sliding_window': None, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.51.0', 'use_cache': True, 'use_sliding_window': False, 'vocab_size': 151936},
    # transcribed from huggingface.co/Qwen/Qwen3-235B-A22B config.json (no vendored copy)
    'qwen3-235b-a22b': {'architectures': ['Qwen3MoeForCausalLM'], 'attention_bias': False, 'attention_dropout': 0.0,
      'bos_token_id': 151643, 'decoder_sparse_step': 1, 'eos_token_id': 151645, 'head_dim': 128,
      'hidden_act': 'silu', 'hidden_size': 4096, 'initializer_range': 0.02, 'intermediate_size': 12288,
      'max_position_embeddings': 40960, 'max_window_layers': 94, 'mlp_only_layers': [], 'model_type': 'qwen3_moe',
      'moe_intermediate_size': 1536, 'norm_topk_prob': True, 'num_attention_heads': 64, 'num_experts': 128,
      'num_experts_per_tok': 8, 'num_hidden_layers': 94, 'num_key_value_heads': 4, 'output_router_logits': False,
      'rms_norm_eps': 1e-06, 'rope_scaling': None, 'rope_theta': 1000000.0, 'router_aux_loss_coef': 0.001,
      'sliding_window': None, 'tie_word_embeddings': False, 'torch_dtype': 'bfloat16',
      'transformers_version': '4.51.0', 'use_cache': True, 'use_sliding_window': False, 'vocab_size': 151936},
}
# the hub repository each preset comes from (for messages and the README)
HUB_REPOS = {
    "llama2-7b": "meta-llama/Llama-2-7b-hf", "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf", "llama3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama3-70b": "meta-llama/Meta-Llama-3-70B", "llama3.1-8b": "meta-llama/Llama-3.1-8B",
    "llama3.1-405b": "meta-llama/Llama-3.1-405B", "llama3.2-1b": "meta-llama/Llama-3.2-1B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1", "qwen2.5-7b": "Qwen/Qwen2.5-7B",
    "mixtral-8x7b": "mistralai/Mixtral-8x7B-v0.1", "mixtral-8x22b": "mistralai/Mixtral-8x22B-v0.1",
    "deepseek-v2-lite": "deepseek-ai/DeepSeek-V2-Lite", "deepseek-v3": "deepseek-ai/DeepSeek-V3",
    "qwen3-8b": "Qwen/Qwen3-8B", "qwen3-32b": "Qwen/Qwen3-32B", "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "qwen3-235b-a22b": "Qwen/Qwen3-235B-A22B",
}


def preset_names() -> list[str]:
    return list(PRESETS)


def hf_config(name: str) -> dict:
    """The preset's HF config.json as a fresh dict (callers may modify it). Unknown name: ConfigError listing all."""
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; known presets: {', '.join(PRESETS)}")
    return copy.deepcopy(PRESETS[key])


# What transformers reads for the fields some hub files leave out (its config classes' defaults; where it has none,
# what ModelConfig.from_hf assumes without it): filled in so that a preset is read without importing transformers
# (~2 s of CPU at every `plan`). tests/test_plan.py checks each preset gives the same ModelConfig both ways.
OMITTED_DEFAULTS = {
    "llama": {"attention_bias": False, "mlp_bias": False, "rope_theta": 10000.0},
    "deepseek_v2": {"mlp_bias": False, "rope_interleave": True, "num_nextn_predict_layers": 0},
    "deepseek_v3": {"mlp_bias": False, "rope_interleave": True},
}


def model_config(name: str, fill_defaults: bool = True) -> ModelConfig:
    """The preset as shardkit's ModelConfig (through ModelConfig.from_hf, like a config.json on disk), the fields its
    hub file omits filled from OMITTED_DEFAULTS (`fill_defaults=False`: from transformers, as for a file on disk)."""
    hf = hf_config(name)
    if fill_defaults:
        for key, value in OMITTED_DEFAULTS.get(hf.get("model_type"), {}).items():
            hf.setdefault(key, value)
    return ModelConfig.from_hf(hf, source=f"preset {name} ({HUB_REPOS[name.lower()]})")
