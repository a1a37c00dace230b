"""The suite's one list of slow cases: `make test` (CI) leaves them out (pyproject.toml: -m 'not slow'),
`make test-all` runs them. Each is a further layout, size or fault of a code path that a case in the default run
already covers (named beside it), so the default run stays under 15 minutes on 2 cores without dropping coverage."""
from __future__ import annotations

import pytest

SLOW = {
    # stop 46's trim (the default run had reached 13.5 min on 2 cores), each beside the default case that keeps its path:
    # SLURM requeue + USR1 save: test_no_traceback.py::test_requeue_resumes_a_native_or_torch_dist_save (the requeued
    # resume) and test_megatron_flags.py::test_training_exit_joins_the_groups_threads (the exit-signal save) stay
    "tests/test_slurm.py::test_requeue_scancel_mid_save_resumes_and_usr1_saves",
    # the FP8 fields against Megatron-LM's own parser (~10 s of importing it): test_fp8_fields_accepted_by_the_engines_
    # megatron_core stays (megatron-core 0.16 and 0.19 validate the same fields)
    "tests/test_engine_megatron_core_te.py::test_fp8_fields_match_megatron_lm",
    # CP's split against megatron-core 0.19's get_batch_on_this_cp_rank: [engine] (0.16's, the engine's) stays
    "tests/test_engine_megatron_core_cp.py::test_cp_split_is_megatron_cores[0.19]",
    # MLA under CP on the engine: CP attention by [cp2], MLA's own core attention by the DeepSeek engine cases
    "tests/test_engine_megatron_core_cp.py::test_mla_context_parallel_equals_native",
    # Megatron-LM's uneven legacy stages: [first_last] stays
    "tests/test_pipeline_split.py::test_legacy_uneven_stages_convert[layout_vpp_empty_chunk]",
    # context parallelism on the megatron-core engine: [cp2] (ring), [cp2-tp2-sp], the packed all-gather case, Mixtral
    # at CP 2 x EP 2, MLA at CP 2 and the CP 2 x DP 2 save resuming on native stay in the default run
    "tests/test_engine_megatron_core_cp.py::test_context_parallel_equals_native[cp2-allgather]",
    "tests/test_engine_megatron_core_cp.py::test_context_parallel_equals_native[cp2-dp2]",
    "tests/test_engine_megatron_core_cp.py::test_context_parallel_equals_native[cp2-pp2]",
    "tests/test_engine_megatron_core_cp.py::test_native_save_resumes_on_megatron_core",
    "tests/test_engine_megatron_core_cp.py::test_packed_documents_equal_native[cp2]",
    "tests/test_engine_megatron_core_cp.py::test_mixtral_context_parallel_equals_native[ep1]",
    # DeepSeek on the megatron-core engine: [deepseek_v3-1rank] and [deepseek_v3-tp2-sp] stay (MLA, MTP, expert bias,
    # the dense-then-MoE split), the native save resuming there at PP 2 stays (test_native_save_resumes_on_megatron_core),
    # V2-Lite at TP 2 + SP stays (no q_lora, softmax router)
    "tests/test_engine_megatron_core_deepseek.py::test_deepseek_equals_native[deepseek_v3-ep2]",
    "tests/test_engine_megatron_core_deepseek.py::test_deepseek_equals_native[deepseek_v3-pp2]",
    "tests/test_engine_megatron_core_deepseek.py::test_deepseek_equals_native[deepseek_v2_lite-1rank]",
    # stop 45's trim (the default run had grown to 14 min on 2 cores), each beside the default case that keeps its path:
    # FP8 block scales requantized on export: test_keep_fp8_round_trip_bitwise and test_fp8_dequantized_equals_reference
    "tests/test_convert_moe.py::test_fp8_requantized_export",
    # ranks byte-identical to one process: llama-tp2pp2 stays (the same distributed writer for DeepSeek's FP8 experts)
    "tests/test_scale_out.py::test_ranks_byte_identical[deepseek-v3-fp8-ep2]",
    # a killed rank, rerun: test_rank_killed_then_resumed[rank.done:1@2] stays (the same commit path for the export,
    # torch_dist and the rename kill site); two ranks writing one output: test_output_not_shared stays
    "tests/test_scale_out.py::test_hf_export_rank_killed_then_rerun",
    "tests/test_scale_out.py::test_torch_dist_rank_killed_then_resumed",
    "tests/test_scale_out.py::test_rank_killed_then_resumed[commit.rename:1@0]",
    "tests/test_scale_out.py::test_hf_export_output_not_shared",
    # SLURM's task variables: tests/test_slurm.py runs real sbatch jobs
    "tests/test_scale_out.py::test_slurm_tasks",
    # dropout's replicas under TP: [tp2-sp] stays (the same RNG streams, with SP's sequence slices)
    "tests/test_megatron_flags.py::test_tp2_dropout_keeps_replicas_identical[tp2]",
    # CP under NCCL's rules: [cp2] stays
    "tests/test_nccl_model.py::test_training_under_the_model_equals_the_unconstrained_run[cp3]",
    # a killed reshard: test_kill_conversion stays (the same writer and resume log)
    "tests/test_faults.py::test_kill_reshard",
    # parallel writer processes: test_convert.py::test_parallel_workers_equal_single_process stays
    "tests/test_megatron_legacy.py::test_parallel_workers",
    # cross-engine resumes: native -> megatron-core and megatron-core -> native stay
    "tests/test_engine_megatron_core.py::test_megatron_core_save_resumes_on_megatron_core_at_another_layout",
    # Qwen3-MoE at EP 2: tp2-sp stays (q/k norms, router, experts over ETP), Mixtral's and DeepSeek's EP cases stay
    "tests/test_qwen3.py::test_qwen3_moe_training_equals_one_process[ep2]",
    # MoE presets planned: qwen3-8b and qwen3-32b stay (plan's MoE search: test_plan.py's Mixtral / DeepSeek cases)
    "tests/test_qwen3.py::test_qwen3_presets_plan[qwen3-30b-a3b]",
    "tests/test_qwen3.py::test_qwen3_presets_plan[qwen3-235b-a22b]",
    # torchtitan -> ours -> continue-pretrain -> torchtitan (issue 39): each hop is in the default run's
    # test_deepseek_v3_against_torchtitan (both --optimizer directions, torchtitan resuming) but for the trainer's run
    "tests/test_torchtitan.py::test_deepseek_v3_training_through_continue_pretrain",
    # Kimi-K2's shape planned at 512 GPUs (~13 CPU-s of search): test_kimi_k2_shape_is_config_only reads the same
    # config, test_qwen3_presets_plan plans the Qwen3 presets
    "tests/test_qwen3.py::test_kimi_k2_shape_plans",
    # FP8 emulation on Qwen3's layer (40 emulated steps): test_fp8.py's recipes run it on Llama's
    "tests/test_qwen3.py::test_qwen3_fp8_emulated_tracks_bf16",
    # Qwen3-MoE on the megatron-core engine at TP 2 + SP: qwen3-tp2 (q/k norms summed over TP without SP) and
    # test_mixtral_equals_native[tp2-sp] (megatron-core's MoE under SP) stay
    "tests/test_engine_megatron_core.py::test_qwen3_equals_native[qwen3_moe-tp2-sp]",
    # Qwen3-MoE training: ep2 (alltoall) and tp2-sp stay; the allgather dispatcher, PP and CP are the same code paths as
    # Mixtral's and DeepSeek's cases (tests/test_train_moe.py, test_context_parallel.py) with q/k norms in the layer
    "tests/test_qwen3.py::test_qwen3_moe_training_equals_one_process[ep2-allgather]",
    "tests/test_qwen3.py::test_qwen3_moe_training_equals_one_process[pp2-first1]",
    "tests/test_qwen3.py::test_qwen3_moe_training_equals_one_process[cp2]",
    # object storage (issue 38): test_two_ranks_save_to_s3_killed_then_resumed stays (continue-pretrain --load and
    # --save s3://, sync and async saves, bitwise vs local, a kill after every rank's objects, before the manifest);
    # the kill after the manifest, before `latest`, stays as test_kill_during_save_to_s3[storage.manifest]
    "tests/test_object_storage.py::test_kill_during_save_to_s3[storage.objects]",
    "tests/test_object_storage.py::test_continue_pretrain_load_save_on_s3",
    # rank 1 of 2 killed while putting its chunk objects: the same path as test_two_ranks_save_to_s3_killed_then_
    # resumed (an iteration without manifest.json, latest unmoved, the rerun completes), another rank and site
    "tests/test_object_storage.py::test_rank_killed_while_putting_its_chunks",
    # a conversion to s3:// killed and resumed from its staging root (two subprocesses): the staging root is the
    # local writer's own resume (test_checkpointing / test_faults), a kill before a manifest stays via
    # test_two_ranks_save_to_s3_killed_then_resumed
    "tests/test_object_storage.py::test_interrupted_conversion_to_s3_resumes",
    # megatron-core 0.19.2 / Megatron-Bridge 0.6.2 (issue 41): their Python 3.12 environment takes minutes to build
    # on a fresh machine (scripts/oracle_env.sh); the default run keeps test_megatron_write_newest.py's checks of the
    # files themselves (common-state layouts, integrity.json, the args 0.19 needs) and test_torch_dist.py's 0.16 load
    "tests/test_megatron_write_newest.py::test_loaded_by_megatron_core_019[0.16]",
    "tests/test_megatron_write_newest.py::test_loaded_by_megatron_core_019[0.19]",
    "tests/test_megatron_write_newest.py::test_exported_by_megatron_bridge_bitwise[vocab1024]",
    "tests/test_megatron_write_newest.py::test_exported_by_megatron_bridge_bitwise[vocab1000-divisible-by-4]",
    "tests/test_megatron_write_newest.py::test_training_save_loaded_by_megatron_core_019",
    # the megatron-core engine (issue 40): pp2-vpp2-layout stays (megatron-core's 1F1B machinery, interleaved, under
    # the NCCL model, with an uneven layout string: it covers pp2-first1 and pp2-vpp2), with 1rank, tp2-sp, dp2-overlap
    "tests/test_engine_megatron_core.py::test_megatron_core_equals_native[pp2-vpp2]",
    "tests/test_engine_megatron_core.py::test_megatron_core_equals_native[pp2]",
    "tests/test_engine_megatron_core.py::test_megatron_core_equals_native[pp2-first1]",
    # packed documents on megatron-core: the 1rank case stays (mask, positions and loss mask are per micro-batch)
    "tests/test_engine_megatron_core.py::test_packed_documents_equal_native[tp2-sp]",
    # Mixtral on megatron-core: 1rank (alltoall dispatcher), ep2 and tp2-sp-etp1-ep2 (TP + SP with experts) stay
    "tests/test_engine_megatron_core.py::test_mixtral_equals_native[1rank-allgather]",
    "tests/test_engine_megatron_core.py::test_mixtral_equals_native[tp2-sp]",
    "tests/test_engine_megatron_core.py::test_mixtral_equals_native[ep2]",  # EP 2 runs in tp2-sp-etp1-ep2
    "tests/test_engine_megatron_core.py::test_tied_embeddings_at_pp2",
    "tests/test_engine_megatron_core.py::test_torch_dist_save_resumes_on_native",
    "tests/test_engine_megatron_core.py::test_bf16_follows_native",
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
    # MTP with CP: docs-cp2ep2 stays (the same shift across the chunks, within documents too; megatron-core's own CP
    # roll is test_mtp_megatron's)
    "tests/test_train_moe.py::test_mtp_with_context_parallel_equals_one_process[cp2]",
    "tests/test_train_moe.py::test_mtp_with_context_parallel_equals_one_process[docs-cp2tp2-sp]",
    # MoE/MLA at TP: mixtral-tp2-pp2-ep2-etp1 (ETP 1) and deepseek_v3-tp2-ep2 (MLA at TP) stay
    "tests/test_train_moe_tp.py::test_tensor_parallel_moe_equals_one_process[mixtral-tp2-sp]",
    "tests/test_train_moe_tp.py::test_tensor_parallel_moe_equals_one_process[deepseek_v3-tp2-etp1]",
    "tests/test_train_moe_tp.py::test_tensor_parallel_moe_equals_one_process[mixtral-tp2-ep2-allgather]",
    "tests/test_train_moe_tp.py::test_tensor_parallel_moe_equals_one_process[deepseek_v3_no_q_lora-tp2-sp]",
    # resume after a reshard to another expert layout: the 2-rank tp2-etp1-to-tp1-ep2 stays (the same path)
    "tests/test_train_moe_tp.py::test_resumes_after_reshard_to_another_expert_layout[tp2-ep2-etp1-to-tp1-ep4]",
    # scale-out conversion: llama-tp2pp2 and deepseek-v3-fp8-ep2 stay; the three named kill sites stay
    "tests/test_scale_out.py::test_ranks_byte_identical[mixtral-ep2]",
    "tests/test_scale_out.py::test_ranks_byte_identical[reshard-tp4pp2]",
    "tests/test_scale_out.py::test_rank_killed_then_resumed[chunk:1@1!stop]",
    # a chunk written but not yet recorded: the kill/resume path of rank.done:1@2 and commit.rename:1@0
    "tests/test_scale_out.py::test_rank_killed_then_resumed[chunk.unrecorded:1@1]",
    # torch_dist across ranks: the dense export at 2 and 3 ranks and torch_dist -> torch_dist (import and export
    # across ranks) stay
    "tests/test_scale_out.py::test_torch_dist_ranks_byte_identical[mixtral-ep2-td-3]",
    "tests/test_scale_out.py::test_torch_dist_ranks_byte_identical[reshard-td-to-native-2]",
    "tests/test_scale_out.py::test_torch_dist_ranks_byte_identical[reshard-native-to-td-3]",
    # the HF export across ranks: the kill-then-rerun case (2 ranks killed, 3 ranks byte-identical into a new OUT)
    # stays; these are the same per-rank shard path into an existing OUT and from a torch_dist source
    "tests/test_scale_out.py::test_hf_export_ranks_into_existing_output",
    "tests/test_scale_out.py::test_hf_export_torch_dist_source_ranks",
    # the one-process and the tp1 cases stay
    "tests/test_nan_stop.py::test_nan_stops_tensor_parallel",
    "tests/test_data_vocab.py::test_out_of_vocab_ids_stop_before_step_one[tp2]",
    # MTP against megatron-core: dense-1 and moe-2 stay
    "tests/test_mtp_megatron.py::test_mtp_matches_megatron_core[dense-2]",
    # NCCL's rules on real runs: pp2, pp2-vpp2, pp4-vpp2, cp2, cp3, tp2-pp2 and ep2-pp2 stay (the same 1F1B,
    # interleaved and ring exchanges at other sizes)
    "tests/test_nccl_model.py::test_training_under_the_model_equals_the_unconstrained_run[pp4]",
    "tests/test_nccl_model.py::test_training_under_the_model_equals_the_unconstrained_run[cp4]",
    "tests/test_nccl_model.py::test_training_under_the_model_equals_the_unconstrained_run[cp2-pp2]",
    # the demo (`make demo` runs it) and the benchmark scripts end to end (their code runs in the tests above)
    "tests/test_cli.py::test_demo_runs_and_continues_pretraining",
    "tests/test_bench_train.py::test_bench_train_tiny",
    "tests/test_bench_train.py::test_bench_train_torchrun_layouts",
    "tests/test_streaming_pieces.py::test_bench_verify_smoke",
    # MoE training from and to torch_dist against megatron-core at EP 2 (one fixture: shardkit at EP 2, then one
    # megatron-core torchrun pair): EP 2 continued and both saves loaded stay; other layouts continued, bad input
    "tests/test_train_torch_dist.py::test_continue_megatron_core_moe_training[ep1]",
    "tests/test_train_torch_dist.py::test_continue_megatron_core_moe_training[tp2sp-ep2-etp1]",
    "tests/test_train_torch_dist.py::test_bad_moe_torch_dist_load_is_one_line",
    "tests/test_train_torch_dist.py::test_grouped_expert_spec_reads_the_same_keys",
    # continue-pretrain's errors under torchrun (issue 37): the --lr nan case through shardkit.torchrun stays (the
    # same one-line path; the store's election itself is test_said_once_per_line_through_the_agent_store)
    "tests/test_torchrun_errors.py::test_checkpoint_mismatch_is_one_line_under_torchrun",
    "tests/test_torchrun_errors.py::test_bad_flag_under_stock_torchrun",
    "tests/test_torchrun_errors.py::test_argparse_error_is_one_line_under_torchrun",
    # plan's activations against a live saved-tensor measurement at a tiny width (issue 40; both engines spawned):
    # test_engine_activations_equal_the_benchmark stays (the measured table at Llama-3 widths, exact native list)
    "tests/test_plan.py::test_engine_activations_equal_a_live_measurement",
}


def pytest_collection_modifyitems(config, items):
    found = set()
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
            found.add(item.nodeid)
    if config.getoption("-k") == "" and not config.args[1:] and len(items) > 800 and found != SLOW:
        raise pytest.UsageError(f"tests/conftest.py SLOW names cases that do not exist: {sorted(SLOW - found)}")
