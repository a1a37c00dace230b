"""megatron-core's own dataset builder as a test oracle for train/data.py. Run as a script in a subprocess (importing
megatron-core in the test process would register its pickle safe globals):

    python tests/megatron_data_oracle.py jobs.json out.json

jobs.json: a list of {"blend": [...--data-path words...], "split": "969,30,1", "seed": 1234, "seq_length": 16,
"sizes": [train, valid, test], "cache": DIR}. out.json: for each job and split, every sample's tokens (int lists) in
order, and for plain GPTDatasets the document/sample/shuffle indices; null for a split that was not built.
"""
from __future__ import annotations

import json
import sys


class _Tokenizer:
    """The few attributes GPTDatasetConfig and GPTDataset read (no tokenization happens when reading .bin files)."""

    vocab_size = None
    eod = 2
    pad = -1
    unique_identifiers = {"class": "oracle"}


def run(job: dict) -> list:
    from megatron.core.datasets.blended_dataset import BlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

    cfg = GPTDatasetConfig(random_seed=job["seed"], sequence_length=job["seq_length"],
                           blend=get_blend_from_list(job["blend"]), split=job["split"], path_to_cache=job["cache"],
                           tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, mmap_bin_files=True)
    out = []
    for ds in BlendedMegatronDatasetBuilder(GPTDataset, job["sizes"], lambda: True, cfg).build():
        if ds is None:
            out.append(None)
            continue
        entry: dict = {}
        if isinstance(ds, BlendedDataset):
            samples = [ds.datasets[int(d)]._query_document_sample_shuffle_indices(int(s))[0].tolist()
                       for d, s in zip(ds.dataset_index, ds.dataset_sample_index)]
            entry["dataset_index"] = ds.dataset_index.tolist()
        else:
            samples = [ds._query_document_sample_shuffle_indices(i)[0].tolist() for i in range(len(ds))]
            entry.update(document_index=ds.document_index.tolist(), sample_index=ds.sample_index.tolist(),
                         shuffle_index=ds.shuffle_index.tolist())
        entry["samples"] = samples
        out.append(entry)
    return out


if __name__ == "__main__":
    import os

    import torch

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)  # BlendedDataset asks for the rank
    jobs = json.loads(open(sys.argv[1]).read())
    with open(sys.argv[2], "w") as f:
        json.dump([run(j) for j in jobs], f)
