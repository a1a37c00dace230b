"""Training data, one module per concern (each imports only those listed before it):

- errors: DataError, the one error of the package;
- stats: the token-statistics sidecar (`<prefix>.shardkit.json`) and the tokenizer record it holds;
- indexed: Megatron's indexed dataset (`.bin`/`.idx`): its format, IndexedWriter / write_indexed, IndexedDataset;
- preprocess: `shardkit preprocess-data` (JSONL -> `.bin`/`.idx`), the bundled corpus and its tokenizer;
- order: megatron-core's GPT sample order (GPTDataset, BlendedDataset), blends, splits, build_datasets, and the check
  of every dataset's token ids against the model's vocabulary;
- sampler: micro_batches (Megatron-LM's MegatronPretrainingSampler).
"""
