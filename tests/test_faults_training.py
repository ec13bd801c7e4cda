"""Faults in what today's training runs, injected from outside the suite (tests/fault_plugins/torch_faults.py on
the ranks): a half-precision GEMM wrong only at large K, an attention kernel wrong for one head, AdamW decaying
twice, collectives wrong on sub-groups only. One CPU run carries them all; each turns its own check red and leaves
the cases beside it green (fp32 and small-K GEMMs, SGD and Adam, the default group's collectives)."""

from test_faults_torch import failed_messages, validate_with_faults
from test_validate_cpu import EXIT_FAILED, checks


def test_training_kernel_faults_are_caught_where_they_are(tmp_path):
    proc, report = validate_with_faults(
        tmp_path, ["half-gemm-wrong-at-large-k", "attention-head-wrong", "adamw-decays-twice", "sub-group-corrupts"],
        "--max-check-bytes", "64K",
        "-k", "gemms_at_every or attention or optimizer_step or sub_groups or all_reduce and sum-float32 "
              "or float64_reference and float32")
    assert proc.returncode == EXIT_FAILED, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed, passed = failed_messages(report), set(checks(report, "passed"))

    gemm = failed["libraries::gemms_at_every_k_class"]  # bf16 at the medium and large K, nothing else
    assert "bfloat16 GEMM at medium K = 2080" in gemm and "bfloat16 GEMM at large K = 8224" in gemm, gemm
    assert "small K" not in gemm and "float32 GEMM" not in gemm, gemm

    for backend in ("flash", "math"):  # the CPU's backends: every case, forward and backward
        message = failed[f"attention::attention_gives_the_known_answer[{backend}]"]
        assert "error / tolerance out" in message and "x (head 1)" in message and "(head 0)" not in message, message

    for form in ("for-loop", "foreach", "fused"):
        assert f"torch.optim.AdamW ({form}, cpu)" in failed[f"optimizers::optimizer_step_equals_the_reference"
                                                            f"[AdamW-{form}]"]
        assert {f"optimizers::optimizer_step_equals_the_reference[{name}-{form}]" for name in ("SGD", "Adam")} <= passed

    for axis, words in (("tp", "all_reduce sum of 4097"), ("pp", "send/recv of 4097"), ("dp", "all_gather of 4097")):
        message = failed[f"parallel_groups::collectives_on_sub_groups[{axis}]"]
        assert "failed on rank(s) [1] of 2" in message and words in message, message
    assert "collectives::all_reduce[sum-float32]" in passed  # the default group's collectives stay right
    for mode in ("ddp", "fsdp2"):  # the wrong head reaches the training step's gradients: the reference is by formula
        message = failed[f"transformer::training_step_equals_the_float64_reference[{mode}-float32]"]
        assert "gradient of qkv.weight" in message and "failed on rank(s) [0, 1] of 2" in message, message
    assert set(failed) == {"libraries::gemms_at_every_k_class",
                           *(f"attention::attention_gives_the_known_answer[{b}]" for b in ("flash", "math")),
                           *(f"optimizers::optimizer_step_equals_the_reference[AdamW-{f}]"
                             for f in ("for-loop", "foreach", "fused")),
                           *(f"parallel_groups::collectives_on_sub_groups[{a}]" for a in ("tp", "pp", "dp")),
                           *(f"transformer::training_step_equals_the_float64_reference[{m}-float32]"
                             for m in ("ddp", "fsdp2"))}


def test_gradient_accumulation_that_loses_micro_batches_is_caught_under_ddp_only(tmp_path):
    """DDP's no_sync dropping what it accumulated: the DDP steps are red in every precision (the GradScaler's
    too), FSDP2's (its own accumulation switch) stay green."""
    proc, report = validate_with_faults(tmp_path, ["no-sync-loses-gradients"], "-k", "float64_reference")
    assert proc.returncode == EXIT_FAILED, proc.stdout[-3000:] + proc.stderr[-3000:]
    failed, passed = failed_messages(report), set(checks(report, "passed"))
    name = "transformer::training_step_equals_the_float64_reference"
    assert set(failed) == {f"{name}[ddp-{p}]" for p in ("float32", "bfloat16", "float16")}, failed
    assert {f"{name}[fsdp2-{p}]" for p in ("float32", "bfloat16", "float16")} <= passed
    assert all("gradient of" in message for message in failed.values()), failed
