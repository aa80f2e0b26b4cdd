"""train.py on CPU with gloo: one process, and two or three under torchrun."""
import contextlib
import functools
import gzip
import http.server
import importlib.util
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings

import psutil
import pytest
import torch

from conftest import (HIDDEN_GPUS, REPO, TINY, TRAIN, assert_ok, default_sigint, linux_only, load,
                      metrics, run, torchrun, write_idx)

sys.path.insert(0, str(REPO))
import train  # noqa: E402


def main_in_process(capfd, *argv, backend="gloo"):
    """train.main(argv) here, on the CPU (unless a test fakes a GPU and asks for nccl), for a
    run that stops before it trains: (exit code, stdout, stderr). A traceback would be an
    exception other than SystemExit, failing the test, and so would a warning, which a run
    of its own would print. The torch settings train() makes (the seed, flushing
    denormals) are undone."""
    with pytest.raises(SystemExit) as stopped, torch.random.fork_rng(devices=[]), \
            warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            train.main([*map(str, argv), "--backend", backend])
        finally:
            torch.set_flush_denormal(False)
    out, err = capfd.readouterr()  # what reaches the file descriptors, C++ logging included
    return stopped.value.code, out, err


def assert_same_tensors(a, b):
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"differ: {different}"


# resnet18: BatchNorm buffers too, and one-channel images; one epoch, as it is 5x slower.
@pytest.mark.parametrize("arch, epochs", [("cnn", 2), ("resnet18", 1)])
def test_two_ranks_end_with_identical_weights_and_exact_eval(mnist_dir, tmp_path, arch, epochs):
    result = torchrun(2, tmp_path, *TINY, "--arch", arch, "--data", mnist_dir, "--epochs", epochs,
                      "--metrics", tmp_path / "m.jsonl", script=REPO / "tests" / "save_every_rank.py")
    assert_ok(result)
    assert_same_tensors(load(tmp_path / "rank0.pt"), load(tmp_path / "rank1.pt"))
    rows = metrics(tmp_path / "m.jsonl")  # only rank 0 writes
    assert [r["epoch"] for r in rows] == list(range(1, epochs + 1))
    for row in rows:
        assert row["world_size"] == 2 and not row["partial"]
        # 101 test images on 2 ranks: counted once each, no padding duplicates.
        assert row["test_samples"] == 101
        assert round(row["test_accuracy"] * 101, 6) == round(row["test_accuracy"] * 101)
        assert row["samples_per_sec"] > 0
    assert result.stdout.count("start: world_size=2") == 1  # rank 0 alone prints
    # The accuracy reported is the saved model's: one process evaluating it agrees.
    args = train.parse_args([*TINY, "--arch", arch, "--data", str(mnist_dir)])
    model = train.build_model(arch)
    model.load_state_dict(load(tmp_path / "rank0.pt"))
    _, _, test_x, test_y = train.build_data(args, 0, 0, torch.device("cpu"))
    loss, accuracy, _ = train.evaluate(model, test_x, test_y, args, torch.device("cpu"), 0, 1)
    assert accuracy == rows[-1]["test_accuracy"]
    assert loss == pytest.approx(rows[-1]["test_loss"], rel=1e-5)


@pytest.mark.parametrize("num_samples", [512, 101])
def test_shards_are_disjoint_cover_the_data_and_reshuffle(num_samples):
    world = 2
    epoch0 = [train.epoch_order(num_samples, 0, r, world, seed=0).tolist() for r in range(world)]
    epoch1 = [train.epoch_order(num_samples, 1, r, world, seed=0).tolist() for r in range(world)]
    assert len(epoch0[0]) == len(epoch0[1])  # equal steps on every rank, or DDP would hang
    assert set(epoch0[0]) | set(epoch0[1]) == set(range(num_samples))
    overlap = set(epoch0[0]) & set(epoch0[1])
    assert len(overlap) == (-num_samples) % world  # only DistributedSampler's padding repeats
    assert epoch0 != epoch1
    assert epoch0 == [train.epoch_order(num_samples, 0, r, world, seed=0).tolist()
                      for r in range(world)]


def test_synthetic_data_is_learnable(tmp_path):
    result = run([sys.executable, TRAIN, "--arch", "cnn", "--dataset", "synthetic",
                  "--max-steps", "60", "--metrics", tmp_path / "m.jsonl"])
    assert_ok(result)
    (row,) = metrics(tmp_path / "m.jsonl")
    assert row["partial"] and row["step"] == 60 and row["test_samples"] == 10_000
    assert row["test_accuracy"] > 0.5  # chance is 0.1


def test_fp16_steps_through_the_scaler_and_bf16_runs(mnist_dir, tmp_path):
    for amp in ("fp16", "bf16"):
        result = run([sys.executable, TRAIN, *TINY, "--data", mnist_dir, "--amp", amp,
                      "--max-steps", "3", "--checkpoint-dir", tmp_path / amp])
        assert_ok(result)
    fp16, bf16 = load(tmp_path / "fp16" / "last.pt"), load(tmp_path / "bf16" / "last.pt")
    # update() ran once per step without overflow, and step() moved the weights.
    assert fp16["scaler"]["_growth_tracker"] == 3 and fp16["scaler"]["scale"] == 2.0 ** 16
    assert fp16["optimizer"]["state"], "the optimizer never stepped"
    assert bf16["scaler"] == {}  # bf16 needs no scaler
    assert all(torch.isfinite(t).all() for t in bf16["model"].values())


def test_resume_mid_epoch_is_bitwise_exact_on_three_ranks(mnist_dir, tmp_path):
    # Three ranks, because two sum every element in the same order whatever DDP's
    # bucket layout; accumulation to cover no_sync. 512/3 -> 171 -> 6 steps per epoch.
    args = [*TINY, "--data", mnist_dir, "--accum-steps", "2", "--epochs", "2"]
    assert_ok(torchrun(3, *args, "--checkpoint-dir", tmp_path / "whole"))
    stopped = torchrun(3, *args, "--checkpoint-dir", tmp_path / "resumed", "--max-steps", "4",
                       "--metrics", tmp_path / "m.jsonl")
    assert_ok(stopped)
    assert metrics(tmp_path / "m.jsonl")[-1]["partial"]
    assert load(tmp_path / "resumed" / "last.pt")["step"] == 4
    resumed = torchrun(3, *args, "--checkpoint-dir", tmp_path / "resumed",
                       "--metrics", tmp_path / "resumed.jsonl")
    assert_ok(resumed)
    assert "resumed from" in resumed.stdout
    # The resumed epoch's row covers only its last two steps, and says so.
    assert [r["partial"] for r in metrics(tmp_path / "resumed.jsonl")] == [True, False]
    assert "epoch 1/2 (its steps 5-6 of 6) step 6 train_loss" in resumed.stdout, resumed.stdout
    whole, again = load(tmp_path / "whole" / "last.pt"), load(tmp_path / "resumed" / "last.pt")
    assert whole["step"] == again["step"] == 12
    assert_same_tensors(whole["model"], again["model"])
    assert whole["optimizer"]["state"].keys() == again["optimizer"]["state"].keys() != set()
    for a, b in zip(whole["optimizer"]["state"].values(), again["optimizer"]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])


def reseeded_state(step):
    """Rank 0's random state where a resume reseeds it, with --seed 0 (train.resume_from)."""
    return torch.Generator().manual_seed((step + 1) << 32).get_state()


def test_resume_at_another_world_size_keeps_the_global_batch(mnist_dir, tmp_path, capfd):
    # A node lost for good: 2 ranks x 16 go on as 1 x 16 x 2 accumulation steps, and meet a
    # run that was 1 x 16 x 2 throughout. Their first 3 steps differ in the order of float
    # sums (1.5e-8); one sample moved to another step moves the weights by 7e-4. Against a
    # 2-rank run, each step's new rounding grows to 4e-5 by the end. 512 samples: neither
    # world size pads the last step.
    args = [*TINY, "--data", mnist_dir, "--epochs", "1"]
    assert_ok(run([sys.executable, TRAIN, *args, "--checkpoint-dir", tmp_path / "whole",
                   "--accum-steps", "2"]))
    assert_ok(torchrun(2, *args, "--checkpoint-dir", tmp_path / "resumed", "--max-steps", "3"))
    resumed = run([sys.executable, TRAIN, *args, "--checkpoint-dir", tmp_path / "resumed",
                   "--accum-steps", "2"])
    assert_ok(resumed)
    assert ("resumed from {} at step 3, as world size 1 x --batch-size 16 x --accum-steps 2 "
            "instead of world size 2 x --batch-size 16 x --accum-steps 1: the same global "
            "batches in the same order (but for the padding of each epoch's last), with new "
            "random states, not bitwise the same run\n".format(tmp_path / "resumed" / "last.pt")
            ) in resumed.stdout, resumed.stdout
    whole, again = load(tmp_path / "whole" / "last.pt"), load(tmp_path / "resumed" / "last.pt")
    assert whole["step"] == again["step"] == 16 and whole["world_size"] == again["world_size"] == 1
    for name, tensor in whole["model"].items():
        torch.testing.assert_close(again["model"][name], tensor, rtol=0, atol=1e-6)
    # No rank of the checkpoint's is this one: rank 0 draws a stream of its own for the step,
    # not the one where --seed began, whose dropout masks would repeat the first steps'. The
    # cnn draws nothing after its weights: the run ends with the stream it resumed with.
    assert torch.equal(again["rng"][0]["cpu"], reseeded_state(3))
    code, _, err = main_in_process(capfd, *args, "--checkpoint-dir", tmp_path / "resumed",
                                   "--epochs", "2", "--accum-steps", "3")  # 48, not 32
    assert code == 1 and err.count("\n") == 1, err
    assert ("was written by a run with a global batch of 32 (world size 1 x --batch-size 16 x "
            "--accum-steps 2), and this one has 48 (world size 1 x --batch-size 16 x "
            "--accum-steps 3): resume needs the same global batch (world size 1 x --batch-size "
            "32 x --accum-steps 1, say)") in err, err
    code, _, err = main_in_process(capfd, *args, "--checkpoint-dir", tmp_path / "resumed",
                                   "--epochs", "2", "--batch-size", "8", "--accum-steps", "2")
    assert code == 1 and "(world size 1 x --batch-size 16 x --accum-steps 2, say)" in err, err


def test_resume_on_another_kind_of_device_draws_a_new_random_stream(mnist_dir, tmp_path):
    # A GPU run's dropout draws from the CUDA generator, and leaves the CPU's where the
    # weights left it: a CPU run that restored it would repeat the first steps' masks. The
    # cnn draws nothing after its weights, so a run ends with the stream it resumed with.
    args = [*TINY, "--data", mnist_dir]
    assert_ok(run([sys.executable, TRAIN, *args, "--checkpoint-dir", tmp_path / "cpu",
                   "--max-steps", "2"]))
    checkpoint = load(tmp_path / "cpu" / "last.pt")
    checkpoint["rng"][0]["cuda"] = torch.zeros(16, dtype=torch.uint8)  # as a GPU run's
    (tmp_path / "gpu").mkdir()
    torch.save(checkpoint, tmp_path / "gpu" / "last.pt")
    for written_on, stream, said in [("cpu", checkpoint["rng"][0]["cpu"], "step 2\n"),  # restored
                                     ("gpu", reseeded_state(2), "step 2, with new random states")]:
        resumed = run([sys.executable, TRAIN, *args, "--checkpoint-dir", tmp_path / written_on,
                       "--max-steps", "4"])
        assert_ok(resumed)
        assert f"resumed from {tmp_path / written_on / 'last.pt'} at {said}" in resumed.stdout
        assert torch.equal(load(tmp_path / written_on / "last.pt")["rng"][0]["cpu"], stream)


def test_corrupt_or_foreign_checkpoint_is_a_clear_error(mnist_dir, tmp_path, capfd):
    ckpt_dir = tmp_path / "ck"
    args = [*TINY, "--data", mnist_dir, "--checkpoint-dir", ckpt_dir]
    assert_ok(run([sys.executable, TRAIN, *args, "--max-steps", "2"]))
    again = run([sys.executable, TRAIN, *args, "--max-steps", "2"])
    assert_ok(again)
    assert "nothing to train" in again.stdout and "train_loss" not in again.stdout
    good = (ckpt_dir / "last.pt").read_bytes()
    (ckpt_dir / "last.pt").write_bytes(good[: len(good) // 2])  # truncated mid-write
    code, _, err = main_in_process(capfd, *args, "--max-steps", "4")
    assert code == 1 and f"checkpoint {ckpt_dir / 'last.pt'} is unreadable" in err
    assert (ckpt_dir / "last.pt").read_bytes() == good[: len(good) // 2]  # left for the user
    (ckpt_dir / "last.pt").write_text("garbage\n")  # torch.load's refusal is paragraphs long
    code, _, err = main_in_process(capfd, *args, "--max-steps", "4")
    assert code == 1 and err.count("\n") == 1 and "is unreadable (UnpicklingError: " in err
    assert "weights_only" not in err  # torch's advice to load it anyway, running its code
    torch.save({"model": {}}, ckpt_dir / "last.pt")  # a dict, but not one train.py wrote
    code, _, err = main_in_process(capfd, *args, "--max-steps", "4")
    assert code == 1 and "holds no args, epoch, optimizer, rng, scaler, step, world_size, so " in err
    (ckpt_dir / "last.pt").write_bytes(good)
    code, _, err = main_in_process(capfd, *args, "--max-steps", "4", "--seed", "7", "--compile")
    assert code == 1 and "--seed 0 (now 7), --compile False (now True)" in err


def test_resume_takes_the_same_data_from_any_path_and_no_other(mnist_dir, tmp_path, capfd):
    ckpt_dir = tmp_path / "ck"
    args = [*TINY, "--checkpoint-dir", ckpt_dir, "--max-steps", "2"]
    assert_ok(run([sys.executable, TRAIN, *args, "--data", mnist_dir]))
    moved, other = tmp_path / "moved", tmp_path / "other"
    shutil.copytree(mnist_dir, moved)
    again = run([sys.executable, TRAIN, *args, "--data", moved])
    assert_ok(again)
    assert "nothing to train" in again.stdout  # resumed: it is at step 2 already
    shutil.copytree(mnist_dir, other)
    images = other / "MNIST" / "raw" / "train-images-idx3-ubyte"
    images.write_bytes(images.read_bytes()[:-1] + b"\x01")  # one pixel of another copy
    code, _, err = main_in_process(capfd, *args, "--data", other)
    assert code == 1 and err.count("\n") == 1, err
    assert "written by a run with data 512 training and 101 test samples, CRC32 " in err, err
    older = {k: v for k, v in load(ckpt_dir / "last.pt").items() if k != "data"}
    torch.save(older, ckpt_dir / "last.pt")  # by a train.py that kept no data identity
    code, _, err = main_in_process(capfd, *args, "--data", mnist_dir)
    assert code == 1 and "written by a run with data (absent) (now 512 training and " in err, err


def test_a_checkpoint_of_other_code_is_a_clear_error(mnist_dir, tmp_path, capfd):
    """A user's copy of train.py changes: an argument added since the checkpoint was
    written, a model of another shape, an argument of a type torch.load refuses."""
    ckpt_dir = tmp_path / "ck"
    args = [*TINY, "--data", mnist_dir, "--checkpoint-dir", ckpt_dir, "--max-steps", "4"]
    assert_ok(run([sys.executable, TRAIN, *args[:-1], "2"]))
    good = load(ckpt_dir / "last.pt")
    older = {**good, "args": {k: v for k, v in good["args"].items() if k != "lr"}}
    torch.save(older, ckpt_dir / "last.pt")  # as if --lr were new: guarded, not ignored
    code, _, err = main_in_process(capfd, *args)
    assert code == 1 and "written by a run with --lr (absent) (now 0.01)" in err, err
    # As if the code's momentum had changed since: load_state_dict would restore the old one.
    # A scheduler's change of the param groups' (OneCycleLR's momentum) is no change of code.
    groups = [{**group, "momentum": 0.5} for group in good["optimizer"]["param_groups"]]
    torch.save({**good, "optimizer": {**good["optimizer"], "param_groups": groups}},
               ckpt_dir / "last.pt")
    assert_ok(run([sys.executable, TRAIN, *args]))
    torch.save({**good, "optimizer_defaults": {**good["optimizer_defaults"], "momentum": 0.5}},
               ckpt_dir / "last.pt")
    code, _, err = main_in_process(capfd, *args)
    assert code == 1 and "written by a run with optimizer momentum 0.5 (now 0.9); " in err, err
    other_model = {**good, "model": {**good["model"], "fc.bias": torch.zeros(11)}}
    torch.save(other_model, ckpt_dir / "last.pt")
    code, _, err = main_in_process(capfd, *args)
    assert code == 1 and err.count("\n") == 1, err
    assert "does not fit this model and optimizer (RuntimeError: Error(s) in loading state_dict " \
           "for SmallCNN: size mismatch for fc.bias" in err, err
    # type=pathlib.Path: torch.load(weights_only=True) would refuse every checkpoint.
    namespace = train.parse_args([str(a) for a in args])
    namespace.out_dir = tmp_path
    model = train.build_model("cnn")
    optimizer = torch.optim.SGD(model.parameters())
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    train.save_checkpoint(str(ckpt_dir / "last.pt"), model, optimizer, scaler, 0, 2, namespace,
                          "the data", torch.device("cpu"), 0)
    checkpoint = train.load_checkpoint(str(ckpt_dir / "last.pt"), namespace, "the data",
                                       optimizer, torch.device("cpu"), 0, 1)
    assert checkpoint["step"] == 2 and checkpoint["args"]["out_dir"] == str(tmp_path)


@contextlib.contextmanager
def fill_disk_at_once(tmp):
    tmp.symlink_to("/dev/full")  # every write fails with ENOSPC
    yield


@contextlib.contextmanager
def fill_disk_mid_file(tmp):
    # Writes past 64 KiB fail with EFBIG (SIGXFSZ ignored), where torch.save raises a
    # RuntimeError instead of the OSError.
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


@pytest.mark.parametrize("fill_disk, message", [
    pytest.param(fill_disk_at_once, "No space left on device", marks=linux_only("/dev/full")),
    (fill_disk_mid_file, "File too large")], ids=["at_once", "mid_file"])
def test_a_failed_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capfd, fill_disk,
                                                                  message):
    model = train.build_model("cnn")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    path, tmp = tmp_path / "last.pt", tmp_path / "last.pt.tmp"

    def save(step):
        train.save_checkpoint(str(path), model, optimizer, scaler, 0, step, train.parse_args([]),
                              "the data", torch.device("cpu"), rank=0)
    save(1)
    with fill_disk(tmp), pytest.raises(SystemExit) as stopped:
        save(2)
    assert stopped.value.code == 1
    assert capfd.readouterr().err == (f"train.py: error: cannot write {tmp}: {message}; "
                                       f"{path} holds the last checkpoint saved, if any\n")
    assert load(path)["step"] == 1
    assert not os.path.lexists(tmp)  # a partial file would take the space that is short


@linux_only("/dev/full")
def test_a_failed_metrics_write_is_one_line_after_the_epoch_is_saved(mnist_dir, tmp_path):
    result = run([sys.executable, TRAIN, *TINY, "--data", mnist_dir, "--max-steps", "2",
                  "--checkpoint-dir", tmp_path, "--metrics", "/dev/full"])  # every write fails
    assert result.returncode == 1
    assert result.stderr.startswith(
        'train.py: error: cannot append to /dev/full: No space left on device; the row: {"epoch": 1, ')
    assert result.stderr.count("\n") == 1
    assert load(tmp_path / "last.pt")["step"] == 2


@pytest.mark.parametrize("launcher", [[], ["-m", "torch.distributed.run", "--standalone",
                                              "--nproc-per-node=2"]], ids=["python", "torchrun"])
def test_ctrl_c_is_one_line_and_status_130(tmp_path, launcher):
    """Under torchrun each rank exits at once, without the process group's teardown."""
    proc = subprocess.Popen(
        [sys.executable, *launcher, TRAIN, "--arch", "cnn", "--dataset", "synthetic",
         "--log-every", "1", "--save-every", "1", "--checkpoint-dir", tmp_path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **HIDDEN_GPUS, "OMP_NUM_THREADS": "1"},
        preexec_fn=default_sigint)  # at its default, python installs its own handler
    try:
        while "step 1/" not in proc.stdout.readline():
            assert proc.poll() is None, proc.stderr.read()
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C, to every process
        _, err = proc.communicate(timeout=30)
        line = f"train.py: interrupted: the same command resumes from {tmp_path}/last.pt\n"
        if launcher:  # torchrun prints its own traceback (SignalException), and exits 1
            assert err.count(line) == 1 and "KeyboardInterrupt" not in err
        else:
            assert (proc.returncode, err) == (130, line)
    finally:
        if proc.poll() is None:  # torchrun stops its workers, in sessions of their own, on SIGTERM
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@linux_only("prctl(PR_SET_PDEATHSIG)")
def test_workers_end_with_a_killed_torchrun(tmp_path):
    """torchrun starts its workers in sessions of their own: a kill -9 of torchrun reaches
    none of them, and they trained on (seen with torch 2.14), writing checkpoints."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         TRAIN, "--arch", "cnn", "--dataset", "synthetic", "--log-every", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
        env={**os.environ, **HIDDEN_GPUS, "OMP_NUM_THREADS": "1"})
    workers = []
    try:
        while "step 1/" not in proc.stdout.readline():
            assert proc.poll() is None, "torchrun ended before training"
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        proc.kill()
        proc.wait()
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers left running: {alive}"
    finally:
        proc.kill()
        proc.wait()
        for worker in workers:
            with contextlib.suppress(psutil.NoSuchProcess):
                worker.kill()


def test_missing_mnist_stops_every_rank_with_one_message(tmp_path):
    result = torchrun(2, "--arch", "cnn", "--dataset", "mnist", "--data", tmp_path / "none",
                      "--no-download", timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("--dataset synthetic") == 1  # from local rank 0 alone
    assert "Traceback (most recent call last):\n  File \"" + str(TRAIN) not in result.stderr


def patched_train(tmp_path, patch):
    """A script that runs `patch`, lines of Python with os and train imported, and argv the
    arguments for train.main, then train.main, and ends as train.py does (os._exit, past
    the C++ teardown that sometimes aborts with gloo)."""
    script = tmp_path / "patched_train.py"
    script.write_text(f"import os, sys\nsys.path.insert(0, {str(REPO)!r})\nimport train\n"
                      f"argv = sys.argv[1:]\n{patch}\ntrain.main(argv)\n"
                      "sys.stdout.flush()\nsys.stderr.flush()\nos._exit(0)\n")
    return script


def torchrun_patched(tmp_path, patch, *args):
    """train.py under torchrun on two ranks, each of which first runs `patch`; it must fail."""
    result = torchrun(2, *args, script=patched_train(tmp_path, patch), timeout=60)
    assert result.returncode != 0 and "step" not in result.stdout
    assert f'File "{TRAIN}"' not in result.stderr  # no traceback through train.py
    return result


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_rank_that_loses_its_peer_says_so_in_one_line(tmp_path, fault):
    # Rank 1 stops in its third forward pass, so rank 0 waits for it in that step's
    # all-reduce. Rank 0 ignores SIGTERM: torchrun's stop, once rank 1 is gone, must not
    # end it before the all-reduce fails.
    patch = f"""import signal, time
if os.environ["RANK"] == "1":
    forward, calls = train.SmallCNN.forward, []
    def stopping_forward(self, x):
        calls.append(x)
        if len(calls) == 3:
            os._exit(1) if {fault!r} == "dies" else time.sleep(60)
        return forward(self, x)
    train.SmallCNN.forward = stopping_forward
else:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
"""
    result = torchrun(2, "--arch", "cnn", "--dataset", "synthetic", "--timeout", "10",
                      script=patched_train(tmp_path, patch), timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("train.py: error: rank 0 lost a peer (") == 1, result.stderr
    assert f'File "{TRAIN}"' not in result.stderr  # no traceback through train.py


@pytest.mark.parametrize("error, shown", [
    ('ValueError("the cause")', "ValueError: the cause"),
    ('BrokenPipeError(32, "Broken pipe")', "BrokenPipeError: [Errno 32] Broken pipe"),  # its own I/O's
])
def test_a_rank_that_fails_alone_shows_its_traceback_and_ends_at_once(tmp_path, error, shown):
    # Rank 1 raises in its third forward pass, while rank 0 waits for it in that step's
    # all-reduce. Rank 1's destroy_process_group never returns, as nccl's may when peers
    # are inside a collective: the rank must not call it on the way out.
    patch = f"""import time
import torch.distributed as dist
if os.environ["RANK"] == "1":
    forward, calls = train.SmallCNN.forward, []
    def failing_forward(self, x):
        calls.append(x)
        if len(calls) == 3:
            raise {error}
        return forward(self, x)
    train.SmallCNN.forward = failing_forward
    dist.destroy_process_group = lambda: time.sleep(60)
"""
    started = time.monotonic()
    result = torchrun(2, "--arch", "cnn", "--dataset", "synthetic", "--timeout", "60",
                      script=patched_train(tmp_path, patch), timeout=90)
    assert result.returncode != 0
    assert f"[rank1]: {shown}" in result.stderr, result.stderr
    assert time.monotonic() - started < 45  # neither rank waited out --timeout


def test_a_download_longer_than_the_timeout_is_waited_for(mnist_dir, tmp_path):
    """Rank 1 waits 10 s for rank 0's download with --timeout 4: no collective lasts as long."""
    patch = f"""import shutil, time, torchvision
def slow_download(root, train, download):
    time.sleep(5)
    shutil.copytree({str(mnist_dir)!r}, root, dirs_exist_ok=True)
torchvision.datasets.MNIST = slow_download"""
    result = torchrun(2, "--arch", "cnn", "--batch-size", "16", "--data", tmp_path / "data",
                      "--timeout", "4", "--max-steps", "2", script=patched_train(tmp_path, patch),
                      timeout=60)
    assert_ok(result)
    assert "(its steps 1-2 of 16) step 2 train_loss" in result.stdout, result.stdout


@pytest.mark.parametrize("archives", ["on_the_mirror", "in_raw"])
def test_a_download_from_a_mirror_leaves_the_four_files_only(mnist_dir, tmp_path, archives):
    """torchvision's own download, from a mirror on loopback that serves the tiny MNIST
    (gzipped, as MNIST's mirrors do: torchvision's checksums are of the real one's); or
    without one, from the archives a user put in MNIST/raw, which torchvision takes."""
    served = tmp_path / "mirror" if archives == "on_the_mirror" else tmp_path / "data" / "MNIST" / "raw"
    served.mkdir(parents=True)
    for name in train.MNIST_FILES:
        (served / f"{name}.gz").write_bytes(gzip.compress((mnist_dir / "MNIST" / "raw" / name).read_bytes()))
    handler = functools.partial(QuietFiles, directory=str(served))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler) as mirror:
        threading.Thread(target=mirror.serve_forever, daemon=True).start()
        port = mirror.server_address[1] if archives == "on_the_mirror" else 9  # refused: offline
        patch = ("import torchvision\n"
                 f"torchvision.datasets.MNIST.mirrors = ['http://127.0.0.1:{port}/']\n"
                 f"torchvision.datasets.MNIST.resources = [(f'{{name}}.gz', None) for name in train.MNIST_FILES]")
        result = torchrun(2, "--arch", "cnn", "--batch-size", "16", "--data", tmp_path / "data", "--max-steps", "2",
                          script=patched_train(tmp_path, patch), timeout=60)
        mirror.shutdown()
    assert_ok(result)
    assert "step 2 train_loss" in result.stdout, result.stdout
    kept = [f"MNIST/raw/{name}.gz" for name in train.MNIST_FILES] if archives == "in_raw" else []
    assert sorted(str(path.relative_to(tmp_path / "data")) for path in (tmp_path / "data").rglob("*")) == [
        "MNIST", "MNIST/raw", *sorted([f"MNIST/raw/{name}" for name in train.MNIST_FILES] + kept)]


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_downloads_into_one_directory_at_once_show_no_half_written_file(mnist_dir, tmp_path, monkeypatch):
    """Where rank 0's download failed, or nodes share a filesystem that rank 0's node does not,
    each node's local rank 0 downloads, at once, into the same --data. torchvision writes
    each file in place, a piece at a time, as this stand-in does."""
    files = {name: (mnist_dir / "MNIST" / "raw" / name).read_bytes() for name in train.MNIST_FILES}

    def mnist_written_in_pieces(root, **_):  # train=, download=
        raw = os.path.join(root, "MNIST", "raw")
        os.makedirs(raw, exist_ok=True)
        for name, data in files.items():
            with open(os.path.join(raw, name), "wb") as f:
                f.write(data[:len(data) // 2])
                f.flush()
                time.sleep(0.1)
                f.write(data[len(data) // 2:])

    monkeypatch.setitem(sys.modules, "torchvision", types.SimpleNamespace(
        datasets=types.SimpleNamespace(MNIST=mnist_written_in_pieces)))
    root = tmp_path / "data"
    downloads = [threading.Thread(target=train.download_mnist, args=(root,)) for _ in range(2)]
    for download in downloads:
        download.start()
    half_written = set()
    while any(download.is_alive() for download in downloads):
        for name, data in files.items():
            with contextlib.suppress(FileNotFoundError):
                if (root / "MNIST" / "raw" / name).read_bytes() != data:
                    half_written.add(name)
        time.sleep(0.01)
    assert not half_written
    assert {path.name: path.read_bytes() for path in (root / "MNIST" / "raw").iterdir()} == files
    assert [path.name for path in root.iterdir()] == ["MNIST"]
    assert sorted(path.name for path in (root / "MNIST" / "raw").iterdir()) == sorted(files)  # nothing else left


def test_a_checkpoint_slower_to_save_and_load_than_the_timeout_is_waited_for(mnist_dir, tmp_path):
    """Rank 0 takes 5 s to write and to read a checkpoint (a large model on a slow disk), with
    --timeout 3: the others wait for it in collectives of a second."""
    patch = """import time, torch
if os.environ["RANK"] == "0":
    write_atomically, load = train.write_atomically, torch.load
    def slow_write(*args, **kwargs):
        time.sleep(5)
        return write_atomically(*args, **kwargs)
    def slow_load(*args, **kwargs):
        # Not checkpoint_step's look at its step, nor all_gather_object's unpickling.
        if str(args[0]).endswith("last.pt") and not kwargs.get("mmap"):
            time.sleep(5)
        return load(*args, **kwargs)
    train.write_atomically, torch.load = slow_write, slow_load"""
    args = [*TINY, "--data", mnist_dir, "--checkpoint-dir", tmp_path / "ckpt", "--timeout", "3"]
    assert_ok(torchrun(2, *args, "--max-steps", "2", timeout=60))
    result = torchrun(2, *args, "--max-steps", "4", script=patched_train(tmp_path, patch), timeout=60)
    assert_ok(result)
    assert "resumed from" in result.stdout and "(its steps 3-4 of 16) step 4 train_loss" in result.stdout, \
        result.stdout
    assert load(tmp_path / "ckpt" / "last.pt")["step"] == 4


@pytest.mark.parametrize("stalled, error", [
    (False, "RuntimeError: Error downloading train-images-idx3-ubyte"),  # refused, as offline
    (True, "TimeoutError: timed out"),  # no answer at all, which would hang the job
], ids=["refused", "stalled"])
def test_a_failed_download_is_one_message_per_node(tmp_path, stalled, error):
    # On loopback: a server whose kernel takes connections that it never reads, or port 9.
    with socket.create_server(("127.0.0.1", 0)) as server:
        mirror = f"http://127.0.0.1:{server.getsockname()[1] if stalled else 9}/"
        result = torchrun_patched(tmp_path, "import torchvision\n"
                                  f"torchvision.datasets.MNIST.mirrors = [{mirror!r}]\n"
                                  "train.DOWNLOAD_STALL_SECONDS = 2",
                                  "--arch", "cnn", "--data", tmp_path / "none")
    assert result.stderr.count("MNIST unavailable on") == 1, result.stderr  # not "not found" too
    assert f"download failed ({error}" in result.stderr, result.stderr


def test_mnist_missing_on_one_rank_only_is_said(mnist_dir, tmp_path):
    # As on a node of its own, where the files are elsewhere: local rank 0 has them.
    result = torchrun_patched(tmp_path, 'if os.environ["LOCAL_RANK"] == "1":\n'
                              '    exists = os.path.exists\n'
                              '    os.path.exists = lambda path: "MNIST" not in path and exists(path)',
                              "--arch", "cnn", "--data", mnist_dir)  # download: on, unused
    assert result.stderr.count("MNIST unavailable on") == 1, result.stderr  # rank 1's, from rank 0
    assert ": not found. Put" in result.stderr


def torchrun_where_rank1_reads_otherwise(tmp_path, mnist_dir, change):
    """train.py on two ranks, where local rank 1 passes each idx file it reads, `data` at
    `path`, through `change`: lines of Python, as if on another node."""
    return torchrun_patched(tmp_path, f"""read_idx = train.read_idx
def read_idx_on_rank1(path):
    data = read_idx(path)
    if os.environ["LOCAL_RANK"] == "1":
        {change}
    return data
train.read_idx = read_idx_on_rank1""", *TINY, "--data", mnist_dir)


def test_mnist_unreadable_on_one_rank_only_stops_every_rank(mnist_dir, tmp_path):
    # The files change under a reader, say: local rank 1 fails, local rank 0 reads them.
    result = torchrun_where_rank1_reads_otherwise(tmp_path, mnist_dir,
                                                   'raise OSError(f"cannot read {path}")')
    assert result.stderr.count("MNIST unavailable on") == 1  # rank 1's, printed by rank 0
    assert "OSError: cannot read" in result.stderr


@pytest.mark.parametrize("change, message", [
    # Another download of MNIST: the same sizes, other bytes.
    ('if "train-images" in path: data = data.clone(); data[0, 0, 0] ^= 1',
     "512 training and 101 test samples"),
    # A truncated copy that still parses: one sample fewer, and as many steps per rank.
    ('if "train-" in path: data = data[:-1]', "511 training and 101 test samples")])
def test_different_data_on_one_rank_stops_every_rank(mnist_dir, tmp_path, change, message):
    result = torchrun_where_rank1_reads_otherwise(tmp_path, mnist_dir, change)
    assert result.stderr.count("differs from rank 0's") == 1 and message in result.stderr


@pytest.mark.parametrize("change, message", [
    (lambda x, y: (x.float() / 255, y), "training images torch.float32 (512, 1, 28, 28) and labels "
     "torch.int64 (512,); normalize and the model take uint8 images (N, C, H, W) and int64 labels (N,)"),
    (lambda x, y: (x[:, 0], y), "training images torch.uint8 (512, 28, 28) and labels torch.int64 (512,); "
     "normalize and the model take uint8 images (N, C, H, W) and int64 labels (N,)"),
    (lambda x, y: (x, y + 1), "training labels from 1 to 10; the model has NUM_CLASSES = 10 outputs"),
], ids=["float_images", "no_channel", "labels_past_the_classes"])
def test_a_build_data_of_your_own_that_gives_other_tensors_stops_in_one_line(capsys, change, message):
    """Float images as ToTensor makes them would train at chance without an error."""
    train_x, train_y = train.synthetic_mnist(512, seed=1)
    test_x, test_y = train.synthetic_mnist(101, seed=2)
    with pytest.raises(SystemExit):
        train.check_data_layout((*change(train_x.unsqueeze(1), train_y), test_x.unsqueeze(1), test_y))
    assert capsys.readouterr().err == f"train.py: error: build_data gave {message}\n"


def test_a_random_split_of_the_data_is_the_same_on_every_rank(mnist_dir, tmp_path):
    # A user's build_data that shuffles with torch's generator, as a train/val split does.
    script = patched_train(tmp_path, """build_data = train.build_data
def build_shuffled_data(*args):
    train_x, train_y, test_x, test_y = build_data(*args)
    order = train.torch.randperm(len(train_x))
    return train_x[order], train_y[order], test_x, test_y
train.build_data = build_shuffled_data""")
    result = torchrun(2, *TINY, "--data", mnist_dir, "--max-steps", "2", script=script, timeout=60)
    assert_ok(result)


def test_other_arguments_on_one_rank_stop_every_rank(tmp_path):
    # As if torchrun had been started by hand on another node with another command line.
    result = torchrun_patched(tmp_path, 'if os.environ["LOCAL_RANK"] == "1":\n'
                              '    argv += ["--seed", "1", "--lr", "0.5"]',
                              "--arch", "cnn", "--dataset", "synthetic")
    assert result.stderr.count("other arguments than rank 0") == 1
    assert "--lr 0.5 (rank 0: 0.01), --seed 1 (rank 0: 0)" in result.stderr


@pytest.mark.parametrize("fresh_store", [False, True])
def test_torchrun_restarts_need_a_fresh_store_per_round(tmp_path, fresh_store):
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1" if fresh_store else "0"}
    result = run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc_per_node=1", "--max-restarts=1", TRAIN, "--arch", "cnn",
                  "--dataset", "synthetic", "--max-steps", "1"], env=env, timeout=90)
    if fresh_store:
        assert_ok(result)
    else:  # refused in each of the two rounds, before any step
        assert result.returncode != 0 and "step" not in result.stdout
        assert result.stderr.count("set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1") == 2
        assert f'File "{TRAIN}"' not in result.stderr


def test_a_closed_stdout_loses_lines_not_the_run(tmp_path):
    """`python train.py | tee log`, and the terminal that ran tee closes."""
    proc = subprocess.Popen(
        [sys.executable, TRAIN, "--arch", "cnn", "--dataset", "synthetic", "--log-every", "1",
         "--max-steps", "30", "--checkpoint-dir", tmp_path],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, **HIDDEN_GPUS, "OMP_NUM_THREADS": "1"})
    try:
        while "step 1/" not in proc.stdout.readline():
            assert proc.poll() is None, proc.stderr.read()
        proc.stdout.close()
        _, err = proc.communicate(timeout=60)
        assert (proc.returncode, err) == (0, "")
        assert load(tmp_path / "last.pt")["step"] == 30
    finally:
        proc.kill()
        proc.wait()


def test_world_size_without_rank_is_one_line(monkeypatch, capfd):
    """Else one process would train on its shard of a world that is not there."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert main_in_process(capfd, "--dataset", "synthetic") == (
        1, "", "train.py: error: WORLD_SIZE is 2 but RANK is not set: start train.py with "
        "torchrun, which sets them all, or unset WORLD_SIZE\n")


def test_rank_set_by_hand_without_torchrun_is_one_line(monkeypatch, capfd):
    monkeypatch.setenv("RANK", "0")
    for name in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main_in_process(capfd, "--dataset", "synthetic") == (
        1, "", "train.py: error: RANK is set but not LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, "
        "MASTER_PORT: start train.py with torchrun, which sets them all, or unset RANK\n")


@pytest.mark.parametrize("master_addr, gloo_socket_ifname, refused", [
    ("10.0.0.11", None, True),
    ("10.0.0.11", "", True),  # torch ignores it
    ("10.0.0.11", "eth0", False),
    ("127.0.0.1", None, False),  # every node on this machine: loopback reaches them all
    ("localhost", None, False),
])
def test_gloo_across_hosts_on_a_name_that_resolves_to_loopback_is_refused(
        monkeypatch, master_addr, gloo_socket_ifname, refused):
    """A unit test: tests/test_torchrun_by_hand.py has the refusal across simulated hosts."""
    monkeypatch.setattr(train.socket, "gethostname", lambda: "localhost")
    monkeypatch.setenv("MASTER_ADDR", master_addr)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    if gloo_socket_ifname is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", gloo_socket_ifname)
    if refused:
        with pytest.raises(train.UsageError, match=r"^this host's name, localhost, gives gloo "
                           r"(127\.0\.0\.1|::1) to listen on, where no other host can reach it"):
            train.check_other_hosts_can_reach_gloo()
    else:
        train.check_other_hosts_can_reach_gloo()


@pytest.mark.parametrize("visible, cuda, device, why", [
    (None, "13.0", "nvidia0", "torch 2.x (CUDA 13.0) sees none: a driver too old for that CUDA, or "
                              "updated without a reboot? (nvidia-smi tells)"),
    ("3", "13.0", "nvidia0", "torch 2.x (CUDA 13.0) sees none: a driver too old for that CUDA, or "
                             "updated without a reboot, or CUDA_VISIBLE_DEVICES=3 names none? "
                             "(nvidia-smi tells)"),
    (None, None, "nvidia0", "torch 2.x is a CPU-only build"),
    ("", "13.0", "nvidia0", None),  # hidden on purpose
    ("-1", "13.0", "nvidia0", None),
    (None, "13.0", "denied", None),  # a scheduler's job given no GPU (a cgroup denies the rest)
    (None, "13.0", "none", None),  # a CPU machine, or a container given no GPU
], ids=["driver", "visible_devices", "cpu_build", "hidden", "hidden_-1", "denied", "none"])
def test_gpus_that_torch_cannot_see_are_named(monkeypatch, tmp_path, visible, cuda, device, why):
    if device == "nvidia0":
        (tmp_path / "nvidia0").write_bytes(b"")
    elif device == "denied":  # as open() fails for it
        (tmp_path / "nvidia0").symlink_to(tmp_path / "gone")
    monkeypatch.setattr(train.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(train.torch, "__version__", "2.x")
    monkeypatch.setattr(train.torch.version, "cuda", cuda)
    monkeypatch.setattr(train.torch.version, "hip", None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    expected = why and f"a GPU ({tmp_path}/nvidia0), but {why}"
    assert train.gpus_torch_cannot_see(f"{tmp_path}/nvidia[0-9]*") == expected


def test_backend_auto_refuses_gpus_that_torch_cannot_see(monkeypatch, capfd):
    """Else it would train on the CPU, or hang beside nodes that run nccl."""
    monkeypatch.setattr(train, "gpus_torch_cannot_see", lambda: "a GPU (/dev/nvidia0), but (why)")
    monkeypatch.setattr(train.socket, "gethostname", lambda: "gpu-03")
    assert main_in_process(capfd, "--dataset", "synthetic", backend="auto") == (
        1, "", "train.py: error: gpu-03 has a GPU (/dev/nvidia0), but (why); pass --backend gloo "
        "to train on the CPU\n")


def test_ctrl_c_of_a_rank_skips_the_process_groups_teardown(monkeypatch):
    """Under nccl, the teardown can wait for collectives that the other ranks, stopped
    elsewhere, never finish."""
    class Exited(Exception):
        pass

    def interrupted(*args):
        raise KeyboardInterrupt

    def exit_now(status):  # the real one never returns
        events.append(f"exit {status}")
        raise Exited

    events = []
    monkeypatch.setattr(train, "setup_distributed", lambda args: (1, 1, 2, torch.device("cpu")))
    monkeypatch.setattr(train, "train", interrupted)
    monkeypatch.setattr(train, "distributed", lambda: True)
    monkeypatch.setattr(train.os, "_exit", exit_now)
    monkeypatch.setattr(train.dist, "destroy_process_group", lambda: events.append("teardown"))
    monkeypatch.setenv("RANK", "1")  # not rank 0: it says nothing
    with pytest.raises(Exited):
        train.main(["--dataset", "synthetic"])
    assert events[0] == "exit 130", events


def test_nccl_without_a_gpu_is_one_message_per_node():
    result = torchrun(2, "--backend", "nccl", "--dataset", "synthetic", timeout=60)
    assert result.returncode != 0 and "step" not in result.stdout
    assert result.stderr.count("--backend nccl needs CUDA") == 1  # from local rank 0 alone
    assert f'File "{TRAIN}"' not in result.stderr


TOO_MANY = ("2 processes on {host}, which has 1 GPU(s) visible: run at most that many "
            "processes per node")


@pytest.mark.parametrize("env, message, waits", [
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, TOO_MANY, False),
    # Local rank 0 says it for the node: the others wait for torchrun to stop them.
    ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, TOO_MANY, True),
    ({"LOCAL_RANK": "1"},  # set by hand, without torchrun: no other rank speaks for this one
     "LOCAL_RANK 1, but {host} has 1 GPU(s) visible: LOCAL_RANK picks the GPU, 0 to 0", False),
    ({"LOCAL_RANK": "-1"},
     "LOCAL_RANK -1, but {host} has 1 GPU(s) visible: LOCAL_RANK picks the GPU, 0 to 0", False),
], ids=["torchrun_local_rank_0", "torchrun_local_rank_1", "by_hand", "negative"])
def test_more_processes_than_gpus_stop_before_cuda(monkeypatch, capfd, env, message, waits):
    """On a machine faked to have one GPU; torch's own error would be a traceback."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("reached set_device"))
    waited = []
    monkeypatch.setattr(train.time, "sleep", waited.append)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    err = f"train.py: error: {message.format(host=socket.gethostname())}\n"
    assert main_in_process(capfd, "--dataset", "synthetic", backend="nccl") == (1, "", err)
    assert bool(waited) == waits


def fake_gpu(monkeypatch, capability, name="Tesla V100-SXM2-32GB"):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize("capability, built, missing", [
    ((7, 0), ["sm_75", "sm_80", "sm_90"], "sm_75 sm_80 sm_90"),  # a V100 under CUDA 13's torch
    ((8, 6), ["sm_80", "sm_90"], ""),  # sm_80's machine code runs on an 8.6
    ((8, 0), ["sm_75", "sm_86"], "sm_75 sm_86"),  # but not sm_86's on an 8.0
    ((9, 0), ["sm_80", "sm_90a"], ""),
    ((10, 3), ["sm_90", "sm_100a"], "sm_90 sm_100a"),  # "a" code runs on its own X.Y alone
    ((10, 3), ["sm_90", "sm_100f"], ""),  # "f" code on its family's
    ((12, 0), ["sm_80", "sm_90", "compute_90"], ""),  # PTX, compiled by the driver
    ((8, 6), ["sm_90", "compute_90"], "sm_90 compute_90"),  # but only for 9.0 and up
    ((12, 0), ["sm_90", "compute_90a"], "sm_90 compute_90a"),  # and "a" PTX for 9.0 alone
    ((8, 0), ["gfx90a", "gfx942"], ""),  # ROCm's names
])
def test_torch_built_for_names_the_architectures_where_none_fits(monkeypatch, capability, built,
                                                                  missing):
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: built)
    assert train.torch_built_for(capability) == missing


def test_nccl_refuses_a_gpu_that_torch_has_no_kernels_for(monkeypatch, capfd):
    """torch's own error comes from every rank at its first kernel, as a traceback."""
    fake_gpu(monkeypatch, (7, 0))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80"])
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: pytest.fail("reached set_device"))
    monkeypatch.setattr(train.socket, "gethostname", lambda: "gpu-03")
    assert main_in_process(capfd, "--dataset", "synthetic", backend="nccl") == (
        1, "", "train.py: error: gpu-03's Tesla V100-SXM2-32GB (compute capability 7.0) has no "
        f"kernels in torch {torch.__version__}, built for sm_75 sm_80: install a torch build "
        "with kernels for sm_70\n")


@pytest.mark.parametrize("amp, device, capability, slow", [
    ("fp16", "cpu", None, "--amp fp16 on the CPU is many times slower than fp32"),
    ("bf16", "cpu", None, None),
    ("bf16", "cuda", (7, 5), "--amp bf16 on a Tesla T4, older than Ampere, is emulated and slow"),
    ("bf16", "cuda", (8, 0), None),
    ("fp16", "cuda", (7, 5), None),
])
def test_slow_amp_warns_where_it_is_slower_than_fp32(monkeypatch, amp, device, capability, slow):
    if capability:
        fake_gpu(monkeypatch, capability, name="Tesla T4")
    found = train.slow_amp(amp, torch.device(device))
    assert found == slow if slow is None else found.startswith(slow), found


def test_bad_arguments_under_torchrun_are_one_message_per_node():
    result = torchrun(2, "--dataset", "synthetic", "--bogus", timeout=60)
    assert result.returncode != 0
    assert result.stderr.count("train.py: error: unrecognized arguments: --bogus") == 1


def test_the_data_check_takes_tensors_of_any_dtype():
    images = torch.arange(12, dtype=torch.uint8).view(3, 2, 2)
    labels = torch.tensor([1, 2, 3])
    # One process, so nothing to differ from: it returns the data's identity (raising
    # nothing, numpy's TypeError on bfloat16 included).
    identity = "3 training and 3 test samples, CRC32 "
    assert train.check_same_data_everywhere((images, labels, images, labels)).startswith(identity)
    assert train.check_same_data_everywhere(
        (images.bfloat16(), labels, images.float().requires_grad_(), labels)).startswith(identity)


def test_read_idx_reads_what_write_idx_wrote(tmp_path):
    images = torch.randint(0, 256, (3, 28, 28), dtype=torch.uint8)
    write_idx(tmp_path / "images", images)
    assert torch.equal(train.read_idx(tmp_path / "images"), images)


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[:-1], "holds 100 bytes of values, not 101"),
    (lambda data: b"<html>" + data, "is not an idx file of uint8"),
    (lambda data: data[:4] + b"\0\0\0\0", "holds no samples"),  # an empty download
    (lambda data: data[:-1] + b"\xc8", "has a label 200; MNIST's are 0 to 9")],  # not MNIST's
    ids=["truncated", "not_idx", "no_samples", "label_200"])
def test_damaged_mnist_file_is_one_line_naming_it(mnist_dir, tmp_path, capfd, damage, message):
    shutil.copytree(mnist_dir, tmp_path / "data")
    labels = tmp_path / "data" / "MNIST" / "raw" / "t10k-labels-idx1-ubyte"
    labels.write_bytes(damage(labels.read_bytes()))
    code, out, err = main_in_process(capfd, *TINY, "--data", tmp_path / "data", "--max-steps", "1")
    assert code == 1 and out == "" and err.count("\n") == 1
    assert f"cannot read them (ValueError: {labels} {message})" in err


def test_compile_without_a_compiler_is_one_line_before_training(tmp_path):
    env = {"CXX": str(tmp_path / "no-compiler"), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    result = run([sys.executable, TRAIN, "--arch", "cnn", "--dataset", "synthetic", "--compile"], env=env)
    assert result.returncode == 1 and "epoch 1/" not in result.stdout
    assert result.stderr.count("train.py: error: --compile cannot compile here (") == 1, result.stderr
    assert result.stderr.endswith("): install a C/C++ compiler (gcc, g++), or drop --compile\n")
    assert "Traceback" not in result.stderr


def test_accumulation_equals_the_larger_batch_when_the_last_step_is_short(mnist_dir, tmp_path):
    # 512 samples in steps of 48: the last step has 32, as micro-batches of 24 and 8.
    for batch, accum in ((48, 1), (24, 2)):
        assert_ok(run([sys.executable, TRAIN, *TINY, "--data", mnist_dir, "--epochs", "1",
                       "--batch-size", batch, "--accum-steps", accum,
                       "--checkpoint-dir", tmp_path / str(accum)]))
    whole, accumulated = (load(tmp_path / d / "last.pt")["model"] for d in ("1", "2"))
    for name in whole:
        torch.testing.assert_close(accumulated[name], whole[name], rtol=0, atol=1e-6)


@pytest.mark.parametrize("setting, message", [
    (["--metrics", "missing/m.jsonl"], "cannot write missing/m.jsonl"),
    (["--checkpoint-dir", "a_file/ck"], "cannot write a_file/ck"),
    (["--checkpoint-dir", "a_file"], "--checkpoint-dir a_file exists and is not a directory"),
    pytest.param(["--checkpoint-dir", "/proc"], "cannot write /proc/last.pt.tmp",  # read-only
                 marks=linux_only("/proc")),
    (["--arch", "resnet18", "--batch-size", "511"], "micro-batches of one sample"),
    (["--arch", "resnet18", "--data", "one_sample"], "use fewer processes, more data, or --arch cnn")])
def test_settings_that_cannot_work_stop_before_training(mnist_dir, tmp_path, monkeypatch, capfd,
                                                        setting, message):
    (tmp_path / "a_file").touch()
    raw = tmp_path / "one_sample" / "MNIST" / "raw"  # as a rank gets when there are too many
    raw.mkdir(parents=True)
    for split in ("train", "t10k"):
        write_idx(raw / f"{split}-images-idx3-ubyte", torch.zeros(1, 28, 28, dtype=torch.uint8))
        write_idx(raw / f"{split}-labels-idx1-ubyte", torch.zeros(1, dtype=torch.uint8))
    monkeypatch.chdir(tmp_path)
    code, out, err = main_in_process(capfd, *TINY, "--data", mnist_dir, *setting)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize("bad", [["--epochs", "-1"], ["--arch", "vgg"], ["--batch-size", "0"],
                                 ["--save-every", "5"], ["--checkpoint-dir", ""], ["--metrics", ""],
                                 ["--lr", "inf"], ["--seed", "-1"], ["--seed", str(2**64)],
                                 ["--timeout", str(10**14)]])
def test_bad_arguments_give_one_line_and_exit_2(capfd, bad):
    code, _, err = main_in_process(capfd, *bad)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "error" in err and bad[0] in err, err


def test_resnet18_without_torchvision_is_said_before_any_work(monkeypatch, capfd):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "torchvision" else find_spec(name, *rest))
    code, _, err = main_in_process(capfd, "--arch", "resnet18", "--dataset", "synthetic")
    assert code == 2
    assert err.count("\n") == 1 and err.endswith(
        ": error: --arch resnet18 needs torchvision: pip install torchvision, or use --arch cnn "
        "(see --help)\n")  # after the program's name, which here is pytest's


def test_help_explains_every_flag(capfd):
    code, out, _ = main_in_process(capfd, "--help")
    assert code == 0
    for flag in ("--dataset", "--arch", "--amp", "--checkpoint-dir", "--max-steps", "--accum-steps"):
        assert flag in out


def test_runs_when_copied_alone_into_an_empty_directory(tmp_path, mnist_dir):
    shutil.copy(TRAIN, tmp_path / "train.py")
    shutil.copytree(mnist_dir, tmp_path / "data")  # the default --data is ./data
    result = run([sys.executable, "train.py", "--arch", "cnn", "--no-download",
                  "--max-steps", "2", "--checkpoint-dir", "ck"], cwd=tmp_path)
    assert_ok(result)
    assert (tmp_path / "ck" / "last.pt").exists()
