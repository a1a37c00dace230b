"""The suite's one list of slow cases: `make test` (CI) leaves them out (pyproject.toml: -m 'not slow'),
`make test-all` runs them. Each is a further layout, size or fault of a code path that a case in the default run
already covers (named beside it), so the default run stays under 15 minutes on 2 cores without dropping coverage."""
from __future__ import annotations

import pytest

SLOW = {
    # context parallelism: docs-cp2tp2-sp-allgather stays (CP x TP x SP, all-gather, packed documents)
    "tests/test_context_parallel.py::test_cp_equals_one_process[cp2]",
    "tests/test_context_parallel.py::test_cp_equals_one_process[cp4-allgather]",
    "tests/test_context_parallel.py::test_cp_equals_one_process[cp2tp2-sp]",
    "tests/test_context_parallel.py::test_cp_equals_one_process[docs-cp4]",
    "tests/test_context_parallel.py::test_cp_equals_one_process[docs-cp2pp2-recompute]",
    # dense layouts: tp2pp2, pp2-first1 and pp2-vpp2-layout stay (the same schedules, uneven), recompute full-1proc
    "tests/test_train.py::test_layouts_equal_one_process[pp2]",
    "tests/test_train.py::test_layouts_equal_one_process[pp2-vpp2]",
    "tests/test_train.py::test_layouts_equal_one_process[tp2-sp]",
    "tests/test_train.py::test_recompute_changes_nothing[selective-pp2]",
    "tests/test_train.py::test_bf16_mixed_precision",
    # resume after a reshard: test_uneven_pipeline_resumes_after_reshard stays (the same path, uneven to even)
    "tests/test_train.py::test_resharded_resume",
    # MoE at EP: the TP x EP (x ETP) cases of test_train_moe_tp and the EP-trained export test stay
    "tests/test_train_moe.py::test_expert_parallel_equals_one_process[mixtral]",
    "tests/test_train_moe.py::test_expert_parallel_equals_one_process[deepseek_v3]",
    # MoE/MLA at TP: mixtral-tp2-pp2-ep2-etp1 (ETP 1) and deepseek_v3-tp2-ep2 (MLA at TP) stay
    "tests/test_train_moe_tp.py::test_tensor_parallel_moe_equals_one_process[mixtral-tp2-sp]",
    "tests/test_train_moe_tp.py::test_tensor_parallel_moe_equals_one_process[deepseek_v3-tp2-etp1]",
    "tests/test_train_moe_tp.py::test_tensor_parallel_moe_equals_one_process[mixtral-tp2-ep2-allgather]",
    "tests/test_train_moe_tp.py::test_tensor_parallel_moe_equals_one_process[deepseek_v3_no_q_lora-tp2-sp]",
    # scale-out conversion: llama-tp2pp2 and deepseek-v3-fp8-ep2 stay; the three named kill sites stay
    "tests/test_scale_out.py::test_ranks_byte_identical[mixtral-ep2]",
    "tests/test_scale_out.py::test_ranks_byte_identical[reshard-tp4pp2]",
    "tests/test_scale_out.py::test_rank_killed_then_resumed[chunk:1@1!stop]",
    # the one-process and the tp1 cases stay
    "tests/test_nan_stop.py::test_nan_stops_tensor_parallel",
    "tests/test_data_vocab.py::test_out_of_vocab_ids_stop_before_step_one[tp2]",
    # MTP against megatron-core: dense-1 and moe-2 stay
    "tests/test_mtp_megatron.py::test_mtp_matches_megatron_core[dense-2]",
    # the demo (`make demo` runs it) and the benchmark scripts end to end (their code runs in the tests above)
    "tests/test_cli.py::test_demo_runs_and_continues_pretraining",
    "tests/test_bench_train.py::test_bench_train_tiny",
    "tests/test_bench_train.py::test_bench_train_torchrun_layouts",
    "tests/test_streaming_pieces.py::test_bench_verify_smoke",
}


def pytest_collection_modifyitems(config, items):
    found = set()
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
            found.add(item.nodeid)
    if config.getoption("-k") == "" and not config.args[1:] and len(items) > 800 and found != SLOW:
        raise pytest.UsageError(f"tests/conftest.py SLOW names cases that do not exist: {sorted(SLOW - found)}")
