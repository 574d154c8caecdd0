"""Suite-wide environment (CPU DeepSpeed with a per-checkout JIT cache, nothing from the network, wandb's files in a
temporary directory of this session instead of under HOME) and the fixture every end-to-end test uses: a tiny
preprocessed corpus (a slice of the Python stdlib with the shipped tokenizer). DeepSpeed's one CPU JIT op (an
inference-only all-reduce) is never built: pretrain.py skips it."""

import os
import shutil
import tempfile
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent

# Spawned ranks inherit these. Any DeepSpeed JIT build (none in training) would land in this checkout's cache.
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(_ROOT / ".cache" / "torch_extensions"))
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# gloo binds to the address the host name resolves to unless told otherwise: keep every test on loopback.
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
# wandb keeps settings, caches, staging and artifacts under HOME (~/.config/wandb, ~/.cache/wandb,
# ~/.local/share/wandb) unless told otherwise: into this session's own directory, set before anything imports wandb
# (and overriding the caller's, which a test run must not touch either). Runs' own files go to their --save dirs.
_WANDB_ROOT = Path(tempfile.mkdtemp(prefix="codegeex-train-tests-wandb-"))
for _name, _sub in (("WANDB_DIR", "runs"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                    ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):
    (_WANDB_ROOT / _sub).mkdir()
    os.environ[_name] = str(_WANDB_ROOT / _sub)


def pytest_unconfigure(config):
    shutil.rmtree(_WANDB_ROOT, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> str:
    from codegeex_train.data.default_corpus import default_corpus_files  # after the environment above
    from codegeex_train.data.preprocess import TokenizerSpec, preprocess

    out = tmp_path_factory.mktemp("data") / "stdlib"
    files = default_corpus_files()[:60]
    summary = preprocess(files, str(out), TokenizerSpec(whitespace_encoding=True), append_eod=True, workers=1,
                         progress=False)
    return summary.output_prefixes[0]


# --- Two tiers ------------------------------------------------------------------------------------------------
# `make test` (CI) runs everything. `make test-fast` (`pytest -m "not slow"`, < 5 min here) leaves out the tests
# below: the ones that take over ~4 s here (launchers, several gloo ranks training, whole-tool runs) except one
# end-to-end case of every feature, which stays fast: pipeline parity at (TP, PP, DP) = (1, 2, 1) and the broken
# tied-gradient hook, exact resume, the step against plain PyTorch at TP 1, the NaN stop at PP 2, one universal
# resume pair, HumanEval on a few tasks, a fine-tuning start and its relaunch, the tokenizer a checkpoint records,
# sequence-parallel parity at (2, 1, 1) with every recompute mode and the model at TP 2 with SP.
# Entries are node ids or their prefixes (a file, a test function).
SLOW = (
    "tests/cluster/",
    "tests/accounting/test_comm_accounting.py::test_counter_volumes_groups_and_restore",
    "tests/benchmarks/test_gpu_check.py",
    "tests/benchmarks/test_recompute_benchmark.py",
    "tests/benchmarks/test_pipeline_benchmark.py",
    "tests/accounting/test_comm_accounting.py::test_selective_recompute_of_all_modules",
    "tests/accounting/test_comm_accounting.py::test_ratios_beside_the_papers",
    "tests/checkpoint/test_finetune.py::test_finetune_starts_a_fresh_run_from_the_weights[universal]",
    "tests/checkpoint/test_finetune.py::test_finetune_starts_a_fresh_run_from_the_weights[weights]",
    "tests/checkpoint/test_finetune.py::test_no_load_optim_restores_all_but_the_optimizer",
    "tests/checkpoint/test_finetune.py::test_no_load_rng_restores_all_but_the_rng",
    "tests/accounting/test_comm_accounting.py::test_tp_bytes_equal_the_seed_formula",
    "tests/checkpoint/test_safe_loading.py::test_convert_refuses_a_tampered_checkpoint",
    "tests/checkpoint/test_safe_loading.py::test_genuine_deepspeed_checkpoint_passes",
    "tests/distributed/test_topology.py::test_cli_json_and_text",
    "tests/distributed/test_topology_distributed.py",
    "tests/evaluation/test_evaluate_tool.py::test_samples_end_to_end",
    "tests/evaluation/test_execution.py::test_canonical_solutions_of_all_164_problems_pass",
    "tests/evaluation/test_humaneval_x.py::test_references_pass_and_stubs_fail[java]",
    "tests/evaluation/test_humaneval_x.py::test_references_pass_and_stubs_fail[go]",
    "tests/generation/test_cache.py::test_cached_logits_equal_full_forward_tp2",
    "tests/generation/test_generate_tool.py::test_bad_input_is_one_error_line",
    "tests/generation/test_generate_tool.py::test_prompt_to_stdout_and_interactive",
    "tests/generation/test_generate_tool.py::test_tp1_and_torchrun_tp2_write_the_same_completions",
    "tests/generation/test_greedy_parity.py::test_greedy_alone_and_without_cache_match",
    "tests/metrics/test_metrics.py::test_no_key_falls_back_to_offline_without_hanging",
    "tests/metrics/test_metrics.py::test_wandb_offline_history_equals_records_and_jsonl",
    "tests/metrics/test_secrets.py::test_a_real_run_leaks_no_credential",
    "tests/model/test_codegeex_weights.py::test_tp2_logits_equal_the_codegeex_package",
    "tests/model/test_model_parallel.py::test_tp_matches_tp1",
    "tests/model/test_model_sequence_parallel.py::test_each_recompute_keeps_less_than_none[4-",
    "tests/model/test_model_sequence_parallel.py::test_sp_parameters_are_layernorms_row_biases_and_tables[4]",
    "tests/model/test_model_sequence_parallel.py::test_sp_matches_tp1[4-",
    "tests/pipeline/test_executor.py",
    "tests/tensor_parallel/test_tp_communication.py",
    "tests/tensor_parallel/test_tp_layers.py::test_bad_sizes_raise_clear_errors",
    "tests/tensor_parallel/test_tp_layers.py::test_layers_match_dense_reference[4-",
    "tests/test_testing.py::test_run_process_group_kills_the_grandchildren_on_timeout",
    "tests/training/test_accounting_runs.py::test_metrics_hold_bytes_by_group_beside_theory",
    "tests/training/test_accounting_runs.py::test_memory_parts_measured_match_theory",
    "tests/training/test_accounting_runs.py::test_planner_predicts_the_measured_run",
    "tests/training/test_batch_and_lr.py",
    "tests/training/test_humaneval_during_training.py",
    "tests/training/test_interleaved_training.py::test_interleaved_matches_single_process[pp2_v2_tp2]",
    "tests/training/test_interleaved_training.py::test_interleaved_matches_single_process[pp2_v3_dp2]",
    "tests/training/test_interleaved_training.py::test_v2_checkpoint_resumes_exactly_at_v1_pp1_and_back",
    "tests/training/test_launchers.py",
    "tests/training/test_memory_flat.py",
    "tests/training/test_memory_check.py::test_the_estimate_is_within_ten_percent_of_the_measured_peak",
    "tests/training/test_numerical_health.py::test_fp16_skips_are_counted_and_a_long_run_of_them_stops",
    "tests/training/test_numerical_health.py::test_inf_grad_norm_stops_dp_ranks",
    "tests/training/test_numerical_health.py::test_no_save_dir_names_no_checkpoint",
    "tests/training/test_numerical_health.py::test_without_per_iteration_checks_a_save_is_still_checked",
    "tests/training/test_pipeline_training.py::test_converted_checkpoint_trains_alike_at_another_layout",
    "tests/training/test_pipeline_training.py::test_pipeline_matches_single_process[1-2-2]",
    "tests/training/test_pipeline_training.py::test_pipeline_matches_single_process[1-4-1]",
    "tests/training/test_pipeline_training.py::test_pipeline_matches_single_process[2-",
    "tests/training/test_pipeline_training.py::test_resume_at_pp2_is_exact",
    "tests/training/test_pipeline_training.py::test_sync_makes_a_different_last_stage_copy_equal",
    "tests/training/test_pretrain.py::test_checkpoint_activations_same_losses",
    "tests/training/test_pretrain.py::test_clip_grad_really_clips",
    "tests/training/test_pretrain.py::test_crash_mid_checkpoint_keeps_previous_latest",
    "tests/training/test_pretrain.py::test_losses_agree_across_tp_and_dp",
    "tests/training/test_pretrain.py::test_wandb_offline_run_matches_metrics_file",
    "tests/training/test_resume_dropout.py::test_resume_with_dropout_is_bitwise_exact",
    "tests/training/test_sequence_parallel.py::test_broken_sequence_parallel_grad_allreduce_is_caught",
    "tests/training/test_sequence_parallel.py::test_checkpoint_saved_with_sp_resumes_without",
    "tests/training/test_sequence_parallel.py::test_sequence_parallel_matches_single_process[2-1-2]",
    "tests/training/test_sequence_parallel.py::test_sequence_parallel_matches_single_process[2-2-",
    "tests/training/test_sequence_parallel.py::test_sequence_parallel_matches_single_process[4-",
    "tests/training/test_step_vs_pytorch.py::test_training_step_matches_plain_pytorch[tp1dp2]",
    "tests/training/test_step_vs_pytorch.py::test_training_step_matches_plain_pytorch[tp2dp1]",
    "tests/training/test_switches.py",
    "tests/training/test_universal_resume.py::test_universal_checkpoint_resumes_at_any_layout",
    "tests/training/test_universal_resume.py::test_layout_mismatch_without_conversion_names_the_fix",
)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of the fast tier (make test-fast); tests/conftest.py SLOW")


def pytest_collection_modifyitems(config, items):
    root = Path(str(config.rootpath))
    for item in items:
        node = Path(item.path).relative_to(root).as_posix() + item.nodeid[len(item.nodeid.split("::")[0]):]
        if node.startswith(SLOW):
            item.add_marker(pytest.mark.slow)
