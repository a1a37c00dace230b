"""verify: the proof of a conversion against the HF model it came from, through transformers' own forward.

against.py: the entry (`verify --against` and the converters' default proof: mode, exact fp32, verdict);
whole.py: the whole-model logit comparison; streamed.py: the streamed one, a bounded piece in memory at a time;
common.py: what both share (transformers' quiet loading, exact fp32, unchanged files, bit-for-bit rows)."""
