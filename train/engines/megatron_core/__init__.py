"""`continue-pretrain --engine megatron-core` (issue 40): megatron-core's own training machinery on shardkit's
checkpoints, data, flags and logs. trainer.py: the engine (its overview there); config.py: TransformerConfig from
shardkit's model config; modules.py: what the engine puts into megatron-core's layer spec; state.py: its optimizer
and FP8 state for shardkit's save path; checks.py: what it takes and refuses; runtime.py: importing megatron-core,
its CPU stand-ins."""
