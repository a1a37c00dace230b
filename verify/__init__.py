"""verify: the proof of a checkpoint, either format: every stored byte re-read, and the logits against the HF model it
came from through transformers' own forward.

run.py: `shardkit verify`, one entry for native and torch_dist checkpoints (checkpoint/opened.py opens either);
report.py: its one printer and verdict line; against.py: the logit comparison's entry (`verify --against` and the
converters' default proof: mode, exact fp32, verdict); whole.py: the whole-model comparison; streamed.py: the
streamed one, a bounded piece in memory at a time (HF's side and ours, layer by layer); hf_weights.py: the HF
safetensors read lazily by range, read ahead and cast by piece; budget.py: which mode, and the pieces' plan within
--memory-budget; common.py: what both share (transformers' quiet loading, exact
fp32, unchanged files, bit-for-bit rows)."""
