"""train.py and check_env.py on CUDA with nccl, one rank per GPU. Skipped where torch sees
no GPU, as in CI: the rest of the suite covers the same code on the CPU with gloo. On a GPU
machine, run them with REQUIRE_GPU_TESTS=1: a driver too old for this torch, or a wrong
CUDA_VISIBLE_DEVICES, hides the GPUs from torch, and the skip then fails instead. On one
GPU, every nccl run has one rank (nccl takes no two ranks on one GPU), so no collective
there crosses processes: that takes 2 GPUs."""
import json
import math
import re
import sys

import pytest
import torch

from conftest import REPO, TRAIN, assert_ok, load, metrics, run, skip_or_fail, torchrun


@pytest.fixture(autouse=True)
def cuda_gpu():
    if not torch.cuda.is_available():
        skip_or_fail("needs a CUDA GPU", required_by="REQUIRE_GPU_TESTS")

SYNTHETIC_CNN = ["--dataset", "synthetic", "--arch", "cnn"]


@pytest.mark.timeout(660)  # its runs' own timeouts add up past pytest.ini's 300 s
def test_nccl_bf16_run_saves_and_resumes(tmp_path):
    gpus = torch.cuda.device_count()
    args = ["--dataset", "synthetic", "--arch", "resnet18", "--amp", "bf16",
            "--checkpoint-dir", tmp_path, "--metrics", tmp_path / "m.jsonl"]
    first = torchrun(gpus, *args, "--max-steps", "20", gpus=True, timeout=300)
    assert_ok(first)
    assert f"start: world_size={gpus} backend=nccl device=cuda:0" in first.stdout
    resumed = torchrun(gpus, *args, "--max-steps", "40", gpus=True, timeout=300)
    assert_ok(resumed)
    assert "at step 20" in resumed.stdout
    rows = metrics(tmp_path / "m.jsonl")
    assert [row["step"] for row in rows] == [20, 40]
    assert all(math.isfinite(row["train_loss"]) for row in rows)
    checkpoint = load(tmp_path / "last.pt")
    assert len(checkpoint["rng"]) == gpus and checkpoint["step"] == 40
    assert all(state["cuda"] is not None for state in checkpoint["rng"])  # each rank's CUDA generator too


def test_checkpoint_moves_from_gpu_to_cpu_and_back(tmp_path):
    args = [sys.executable, TRAIN, *SYNTHETIC_CNN, "--amp", "fp16", "--checkpoint-dir", tmp_path]
    assert_ok(run([*args, "--max-steps", "10"], gpus=True))
    on_cpu = run([*args, "--max-steps", "20"])  # run() hides the GPUs
    assert_ok(on_cpu)
    assert "at step 10" in on_cpu.stdout and "device=cpu" in on_cpu.stdout
    back = run([*args, "--max-steps", "30"], gpus=True)
    assert_ok(back)
    assert "at step 20" in back.stdout and "device=cuda:0" in back.stdout
    assert load(tmp_path / "last.pt")["step"] == 30


@pytest.mark.timeout(660)  # its runs' own timeouts add up past pytest.ini's 300 s
def test_compiled_ddp_model_with_accumulation_learns(tmp_path):
    result = torchrun(1, *SYNTHETIC_CNN, "--compile", "--accum-steps", "2", "--max-steps", "60",
                      "--metrics", tmp_path / "m.jsonl", gpus=True, timeout=600)
    assert_ok(result)
    (row,) = metrics(tmp_path / "m.jsonl")
    assert row["test_accuracy"] > 0.5  # chance is 0.1


def test_check_env_reports_the_gpus():
    report = run([sys.executable, REPO / "check_env.py", "--json"], gpus=True, timeout=120)
    assert_ok(report)
    report = json.loads(report.stdout)
    assert len(report["gpus"]) == torch.cuda.device_count()
    assert all(gpu["free_gib"] > gpu["memory_gib"] / 2 for gpu in report["gpus"]), report["gpus"]  # a context started
    assert report["nccl"] and report["nccl_available"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nccl needs a GPU per rank, 2 ranks")
def test_check_env_times_nccl():
    gpus = torch.cuda.device_count()
    result = run([sys.executable, REPO / "check_env.py", "--nproc", gpus, "--allreduce"],
                 gpus=True, timeout=180)
    assert_ok(result)
    assert f"all-reduce, float32 sum, nccl, 1 node(s), {gpus} ranks" in result.stdout
    assert "WRONG SUM" not in result.stdout
    assert re.search(r"^ +1024 MiB ", result.stdout, re.M), result.stdout  # nccl's sizes go to 1 GiB
