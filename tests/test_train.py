"""train.py on the CPU with gloo: in this process for what needs no peers, else under torchrun."""
import contextlib
import gzip
import http.server
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

import psutil
import pytest
import torch

from conftest import (HIDDEN_GPUS, REPO, TINY, TRAIN, assert_ok, default_sigint, load, metrics,
                      run, torchrun)

sys.path.insert(0, str(REPO))
import train  # noqa: E402


def main_in_process(capfd, *argv):
    """train.main(argv) here, on the CPU: (exit code, stdout, stderr). The torch settings it
    makes (seed, denormals) are undone; a traceback fails the test."""
    with torch.random.fork_rng(devices=[]):
        try:
            train.main([*map(str, argv), "--backend", "gloo"])
            code = 0
        except SystemExit as e:
            code = e.code
        finally:
            torch.set_flush_denormal(False)
    out, err = capfd.readouterr()
    return code, out, err


def patched_train(tmp_path, patch):
    """A script that runs `patch` (Python, with os, sys and train imported), then train.main."""
    script = tmp_path / "patched_train.py"
    script.write_text(f"import os, sys\nsys.path.insert(0, {str(REPO)!r})\nimport train\n"
                      f"{patch}\ntrain.main(sys.argv[1:])\nsys.stdout.flush()\nos._exit(0)\n")
    return script


def assert_same_tensors(a, b):
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert a.keys() == b.keys() and not different, f"differ: {different}"


def planted_rng(rank):
    return torch.Generator().manual_seed(1000 + rank).get_state()


BATCHNORM = """import torch
def cnn_with_batchnorm(channels, classes):  # buffers, which each rank updates on its own
    return torch.nn.Sequential(torch.nn.BatchNorm2d(channels), *train.cnn(channels, classes))
train.MODELS["cnn"] = cnn_with_batchnorm
"""


def test_three_ranks_evaluate_exactly_and_resume_bitwise_with_their_random_states(mnist_dir,
                                                                                   tmp_path):
    # Three ranks: two sum every element in the same order whatever DDP's bucket layout.
    # 512 samples / 3 ranks -> 171 each -> 6 steps of 2 x 16 per epoch, the last one short.
    args = [*TINY, "--data", mnist_dir, "--accum-steps", "2", "--epochs", "2"]
    script = patched_train(tmp_path, BATCHNORM)
    whole = torchrun(3, *args, "--checkpoint-dir", tmp_path / "whole", script=script)
    assert_ok(whole)
    assert_ok(torchrun(3, *args, "--checkpoint-dir", tmp_path / "resumed", "--max-steps", "4",
                       script=script))
    stopped = load(tmp_path / "resumed" / "last.pt")
    assert stopped["step"] == 4
    # No model here draws random numbers: plant known states, which a resume must restore.
    stopped["rng"] = [{"cpu": planted_rng(r), "cuda": None} for r in range(3)]
    torch.save(stopped, tmp_path / "resumed" / "last.pt")
    resumed = torchrun(3, *args, "--checkpoint-dir", tmp_path / "resumed",
                       "--metrics", tmp_path / "m.jsonl", script=script)
    assert_ok(resumed)
    assert f"resumed from {tmp_path / 'resumed' / 'last.pt'} at step 4\n" in resumed.stdout
    a, b = load(tmp_path / "whole" / "last.pt"), load(tmp_path / "resumed" / "last.pt")
    assert a["step"] == b["step"] == 12
    assert_same_tensors(a["model"], b["model"])
    momenta = [[s["momentum_buffer"] for s in c["optimizer"]["state"].values()] for c in (a, b)]
    assert momenta[0] and all(map(torch.equal, *momenta))
    assert all(torch.equal(b["rng"][r]["cpu"], planted_rng(r)) for r in range(3))
    # Rank 0 alone speaks; each epoch is evaluated on all 101 test images, each once.
    assert whole.stdout.count("start: world_size=3") == 1
    rows = metrics(tmp_path / "m.jsonl")
    assert [(r["epoch"], r["step"], r["partial"], r["test_samples"]) for r in rows] == [
        (1, 6, True, 101), (2, 12, False, 101)]
    assert set(rows[0]) == {"epoch", "step", "world_size", "train_loss", "test_loss",
                            "test_accuracy", "test_samples", "samples_per_sec", "partial"}
    # The accuracy reported is the saved model's (rank 0's BatchNorm statistics): one process
    # evaluating it agrees.
    namespace = {"train": types.SimpleNamespace(cnn=train.cnn, MODELS={})}
    exec(BATCHNORM, namespace)
    model = namespace["cnn_with_batchnorm"](1, 10)
    model.load_state_dict(b["model"])
    args = train.parse_args([*TINY, "--data", str(mnist_dir)])
    with world_of_one():
        data, stats = train.build_data(args, torch.device("cpu"))
        loss, accuracy, count = train.evaluate(model, data, stats, args)
    assert (accuracy, count) == (rows[-1]["test_accuracy"], 101)
    assert loss == pytest.approx(rows[-1]["test_loss"], rel=1e-6)


class world_of_one:
    """A gloo process group of this process alone, for train.py's functions."""

    def __enter__(self):
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(),
                                             rank=0, world_size=1)

    def __exit__(self, *exc):
        torch.distributed.destroy_process_group()


def test_ddp_sums_the_first_step_as_every_later_one(monkeypatch):
    """For bitwise resume: DDP re-buckets gradients after its first step, and a resumed run's
    first step would sum in the old layout (which changes gloo's sums at 3 ranks and more)."""
    with world_of_one():
        monkeypatch.setattr(train.dist, "get_world_size", lambda *args: 3)  # as in a job
        ddp = train.wrap_ddp(train.cnn(1, 10), torch.device("cpu"))
        monkeypatch.undo()
        layouts = []
        for _ in range(3):  # DDP's logging says what the forward before the last one used
            ddp(torch.zeros(2, 1, 28, 28)).sum().backward()
            layouts.append(ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices"))
    assert layouts[1] is not None and layouts[1] == layouts[2]


def test_every_epoch_is_shuffled_anew(mnist_dir, tmp_path, capfd, monkeypatch):
    # The pattern's missing set_epoch: the loop must pass each epoch to epoch_order.
    calls = []
    order = train.epoch_order
    monkeypatch.setattr(train, "epoch_order", lambda *a: calls.append(a[1]) or order(*a))
    code, _, err = main_in_process(capfd, *TINY, "--data", mnist_dir, "--epochs", "3",
                                   "--batch-size", "128")
    assert code == 0, err
    assert calls[-3:] == [0, 1, 2]
    shards = [[order(101, epoch, r, 2, seed=0).tolist() for r in (0, 1)] for epoch in (0, 1)]
    assert len(shards[0][0]) == len(shards[0][1]) == 51  # equal steps on every rank
    assert set(shards[0][0]) | set(shards[0][1]) == set(range(101)) and shards[0] != shards[1]


def test_one_process_learns_and_says_so_when_copied_alone(tmp_path):
    shutil.copy(TRAIN, tmp_path)
    result = run([sys.executable, "train.py", "--arch", "cnn", "--dataset", "synthetic",
                  "--max-steps", "60"], cwd=tmp_path)
    assert_ok(result)
    last = result.stdout.splitlines()[-1]
    assert last.startswith("done: step 60/60 in 0:00:") and "(see --checkpoint-dir)" in last
    accuracy = float(last.split("test_acc ")[1].split("%")[0])
    assert accuracy > 50  # chance is 10
    assert sorted(os.listdir(tmp_path)) == ["train.py"]  # no download, nothing written


def test_progress_lines_come_by_time_and_by_step(mnist_dir, tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(train, "PROGRESS_SECONDS", 0)  # every step, by the clock
    code, out, _ = main_in_process(capfd, *TINY, "--data", mnist_dir, "--max-steps", "3",
                                   "--checkpoint-dir", tmp_path)
    assert code == 0
    assert [line.split(" loss")[0] for line in out.splitlines() if " loss " in line] == [
        "epoch 1/2 step 1/3", "epoch 1/2 step 2/3", "epoch 1/2 step 3/3"]
    assert out.splitlines()[-1].endswith(f"checkpoint {tmp_path / 'last.pt'}")
    monkeypatch.setattr(train, "PROGRESS_SECONDS", 3600)
    code, out, _ = main_in_process(capfd, *TINY, "--data", mnist_dir, "--max-steps", "6",
                                   "--checkpoint-dir", tmp_path, "--log-every", "2")
    assert code == 0 and "resumed from" in out
    assert [line.split(" loss")[0] for line in out.splitlines() if " loss " in line] == [
        "epoch 1/2 step 4/6", "epoch 1/2 step 6/6"]


def test_amp_computes_in_fp16_through_the_scaler_and_in_bf16_without(mnist_dir, tmp_path, capfd,
                                                                      monkeypatch):
    dtypes = []  # of the cnn's outputs: autocast at work, or not

    def watched_cnn(channels, classes):
        model = train.cnn(channels, classes)
        model.register_forward_hook(lambda module, inputs, output: dtypes.append(output.dtype))
        return model
    monkeypatch.setitem(train.MODELS, "cnn", watched_cnn)
    for amp, steps in (("fp16", 3), ("fp16", 4), ("bf16", 3)):  # fp16 twice: resumed
        dtypes.clear()
        code, _, err = main_in_process(capfd, *TINY, "--data", mnist_dir, "--amp", amp,
                                       "--max-steps", steps, "--checkpoint-dir", tmp_path / amp)
        assert code == 0, err
        assert dtypes.count({"fp16": torch.float16, "bf16": torch.bfloat16}[amp]) >= 1, dtypes
    fp16, bf16 = load(tmp_path / "fp16" / "last.pt"), load(tmp_path / "bf16" / "last.pt")
    # update() ran once a step without overflow, resumed too, and step() moved the weights.
    assert fp16["scaler"]["_growth_tracker"] == 4 and fp16["scaler"]["scale"] == 2.0 ** 16
    assert fp16["optimizer"]["state"]
    assert bf16["scaler"] == {} and all(torch.isfinite(t).all() for t in bf16["model"].values())


def test_accumulation_equals_the_larger_batch(mnist_dir, tmp_path, capfd):
    # 512 samples in steps of 120: the last has 32, in micro-batches of 30 and 2.
    for name, split in (("big", ["--batch-size", "120"]),
                        ("accum", ["--batch-size", "30", "--accum-steps", "4"])):
        code, _, err = main_in_process(capfd, *TINY, "--data", mnist_dir, *split, "--epochs", "1",
                                       "--checkpoint-dir", tmp_path / name)
        assert code == 0, err
    big, accum = load(tmp_path / "big" / "last.pt"), load(tmp_path / "accum" / "last.pt")
    for name, tensor in big["model"].items():
        torch.testing.assert_close(accum["model"][name], tensor, rtol=0, atol=1e-5)


def test_your_own_data_and_model_plug_in_and_a_mismatch_is_one_line(tmp_path, capfd,
                                                                     monkeypatch):
    def rgb(args):  # 3-channel 32x32 images, as CIFAR-10's
        x, y, tx, ty = train.synthetic(sizes=(256, 64))
        pad = torch.nn.functional.pad
        return pad(x, (2, 2, 2, 2)).expand(-1, 3, -1, -1).contiguous(), y, \
            pad(tx, (2, 2, 2, 2)).expand(-1, 3, -1, -1).contiguous(), ty
    monkeypatch.setitem(train.DATASETS, "rgb", (None, rgb, [0.4] * 3, [0.2] * 3))
    monkeypatch.setitem(train.MODELS, "cnn32", lambda channels, classes: train.cnn(channels, classes, 32))
    code, out, err = main_in_process(capfd, "--dataset", "rgb", "--arch", "cnn32", "--max-steps", "2")
    assert code == 0 and "done: step 2/2" in out, err
    code, out, err = main_in_process(capfd, "--dataset", "rgb", "--arch", "cnn")  # for 28x28
    assert code == 1 and "start:" not in out
    assert err.startswith("train.py: error: --dataset rgb's images, torch.uint8 (256, 3, 32, 32),"
                          " do not fit --arch cnn (") and err.endswith("): see MODELS\n"), err
    floats = [t.float() if t.dim() == 4 else t for t in rgb(None)]
    monkeypatch.setitem(train.DATASETS, "floats", (None, lambda args: floats, [0.4] * 3, [0.2] * 3))
    code, _, err = main_in_process(capfd, "--dataset", "floats", "--arch", "cnn")
    assert code == 1 and "do not fit normalize: give it uint8 (N, C, H, W)" in err, err


@pytest.mark.parametrize("content, message", [
    (b"not a checkpoint", "is unreadable on "),
    ({"weights": 1}, "is not train.py's: move it away"),
])
def test_a_corrupt_or_foreign_checkpoint_is_one_line(mnist_dir, tmp_path, capfd, content, message):
    if isinstance(content, bytes):
        (tmp_path / "last.pt").write_bytes(content)
    else:
        torch.save(content, tmp_path / "last.pt")
    code, out, err = main_in_process(capfd, *TINY, "--data", mnist_dir, "--checkpoint-dir", tmp_path)
    assert code == 1 and "start:" not in out
    assert err.startswith(f"train.py: error: checkpoint {tmp_path / 'last.pt'} {message}")
    assert err.count("\n") == 1, err


def test_a_checkpoint_of_other_settings_or_code_is_one_line(mnist_dir, tmp_path, capfd):
    args = [*TINY, "--data", mnist_dir, "--checkpoint-dir", tmp_path]
    assert main_in_process(capfd, *args, "--max-steps", "2")[0] == 0
    path = tmp_path / "last.pt"
    code, _, err = main_in_process(capfd, *args, "--lr", "0.1", "--batch-size", "8")
    assert code == 1 and err == (
        f"train.py: error: checkpoint {path} was written by a run with --batch-size 16 (now 8), "
        "--lr 0.01 (now 0.1): resume with the same, or use another --checkpoint-dir\n")
    state = load(path)
    state["rng"] *= 2  # as if two ranks had written it
    torch.save(state, path)
    code, _, err = main_in_process(capfd, *args)
    assert code == 1 and "was written by a run with world size 2 (now 1)" in err, err
    state["rng"] = state["rng"][:1]
    state["model"]["1.weight"] = torch.zeros(3)  # a model of other code, under the same arguments
    torch.save(state, path)
    code, _, err = main_in_process(capfd, *args)
    assert code == 1 and err == (f"train.py: error: checkpoint {path} does not fit this model "
                                 "(RuntimeError): use another --checkpoint-dir\n")


@contextlib.contextmanager
def files_of_at_most(size):
    """Writes past `size` bytes fail with EFBIG, as on a disk that fills mid-file."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, limit[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, handler)


def test_a_failed_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path, capfd):
    path, args, cpu = tmp_path / "last.pt", train.parse_args([]), torch.device("cpu")
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    with world_of_one():
        for step, model in ((1, train.cnn(1, 10)), (2, torch.nn.Linear(1000, 1000))):  # 4 MB
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            with files_of_at_most(1 << 20), pytest.raises(SystemExit) if step == 2 else \
                    contextlib.nullcontext():
                train.save_checkpoint(str(path), model, optimizer, scaler, step, args, cpu)
    assert capfd.readouterr().err == (f"train.py: error: cannot write {path}.tmp: File too large; "
                                      f"{path} is as it was\n")
    assert load(path)["step"] == 1 and not os.path.exists(f"{path}.tmp")


def test_a_checkpoint_dir_that_cannot_be_written_fails_before_training(mnist_dir, tmp_path, capfd):
    (tmp_path / "a_file").write_text("")
    code, out, err = main_in_process(capfd, *TINY, "--data", mnist_dir,
                                     "--checkpoint-dir", tmp_path / "a_file")
    assert code == 1 and "step" not in out
    assert err == (f"train.py: error: cannot write {tmp_path}/a_file/last.pt.tmp: File exists; "
                   f"{tmp_path}/a_file/last.pt is as it was\n")


def test_a_failed_download_is_one_line(tmp_path, capfd, monkeypatch):
    def offline(args):  # as torchvision says it, over lines
        raise RuntimeError("Error downloading train-images-idx3-ubyte.gz:\nTried https://a/, got:\n"
                           "<urlopen error [Errno -2] Name or service not known>\n")
    monkeypatch.setitem(train.DATASETS, "mnist", (offline, *train.DATASETS["mnist"][1:]))
    code, _, err = main_in_process(capfd, "--arch", "cnn", "--data", tmp_path)
    assert code == 1 and err.count("\n") == 1, err
    assert "(download failed: RuntimeError: Error downloading train-images-idx3-ubyte.gz: Tried " \
           "https://a/, got: <urlopen error [Errno -2] Name or service not known>): " in err


def test_a_failed_metrics_write_is_one_line_after_the_epoch_is_saved(mnist_dir, tmp_path, capfd):
    code, _, err = main_in_process(capfd, *TINY, "--data", mnist_dir, "--max-steps", "2",
                                   "--checkpoint-dir", tmp_path, "--metrics", "/dev/full")
    assert code == 1 and err.count("\n") == 1
    assert err.startswith('train.py: error: cannot append to /dev/full: No space left on device; '
                          'the row: {"epoch": 1, "step": 2, ')
    assert load(tmp_path / "last.pt")["step"] == 2


@pytest.mark.parametrize("bad", [["--epochs", "-1"], ["--arch", "vgg"], ["--checkpoint-dir", ""],
                                 ["--save-every", "5"]])
def test_bad_arguments_give_one_line_and_exit_2(capfd, bad):
    code, _, err = main_in_process(capfd, *bad)
    assert code == 2 and err.startswith("train.py: error: ") and err.count("\n") == 1, err


def test_help_explains_every_flag(capfd):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    out = capfd.readouterr().out
    for flag in ("--dataset", "--checkpoint-dir", "--save-every", "--log-every", "--amp",
                 "--accum-steps", "--timeout", "--metrics", "--no-download", "--compile"):
        assert flag in out


def test_errors_every_rank_has_are_one_line_per_node(tmp_path):
    # Bad arguments, and MNIST missing with --no-download: no hang, no traceback.
    bad = torchrun(2, "--epochs", "0", timeout=60)
    assert bad.returncode != 0 and bad.stderr.count("train.py: error: argument --epochs") == 1
    missing = torchrun(2, *TINY, "--data", tmp_path, timeout=60)
    assert missing.returncode != 0 and f'File "{TRAIN}"' not in missing.stderr
    assert "No such file or directory" in missing.stderr  # not a download: --no-download
    assert missing.stderr.count("train.py: error: --dataset mnist unavailable on ") == 1, missing.stderr


def test_newest_checkpoint_of_any_node_is_resumed(mnist_dir, tmp_path, capfd):
    """Two nodes of one rank each, sharing no disk: node b's last.pt is newer than a's."""
    assert main_in_process(capfd, *TINY, "--data", mnist_dir, "--max-steps", "2",
                           "--checkpoint-dir", tmp_path / "a")[0] == 0
    state = load(tmp_path / "a" / "last.pt")
    state["rng"] *= 2  # as if two ranks had written it
    torch.save(state, tmp_path / "a" / "last.pt")
    state["step"] = 3
    (tmp_path / "b").mkdir()
    torch.save(state, tmp_path / "b" / "last.pt")
    said = two_nodes(1, TRAIN, *TINY, "--data", mnist_dir, "--max-steps", "5",
                     "--checkpoint-dir", lambda node: tmp_path / node)
    assert said.count("resumed from ") == 1 and " at step 3\n" in said, said
    assert said.count("done: step 5/5") == 1  # rank 0 alone, on whichever node it ran
    assert sorted(load(tmp_path / n / "last.pt")["step"] for n in "ab") in ([2, 5], [3, 5])


def two_nodes(nproc, script, *args):
    """torchrun as two nodes, a and b, on this machine, each of nproc ranks; an argument that
    is a function of the node's name gives each its own. Their output, once both succeeded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--nproc-per-node={nproc}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=t",
         f"--rdzv-conf=is_host={int(node == 'a')}", script,
         *(str(a(node)) if callable(a) else str(a) for a in args)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, **HIDDEN_GPUS, "OMP_NUM_THREADS": "1"}) for node in "ab"]
    outputs = [finish(node, timeout=120) for node in nodes]
    assert all(node.returncode == 0 for node in nodes), outputs
    return "".join(outputs)


def finish(proc, timeout):
    """proc's output once it ends, or once its whole group is killed past timeout."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        return ""
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def start_training(launcher, *args):
    """train.py under `launcher`, training until it is stopped; returns once step 1 is done."""
    proc = subprocess.Popen(
        [sys.executable, *launcher, TRAIN, "--arch", "cnn", "--dataset", "synthetic",
         "--log-every", "1", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, env={**os.environ, **HIDDEN_GPUS, "OMP_NUM_THREADS": "1"},
        preexec_fn=default_sigint)  # SIGINT at its default, as in a terminal
    while "step 1/" not in proc.stdout.readline():
        if proc.poll() is not None:
            pytest.fail(proc.stderr.read())
    return proc


TORCHRUN_2 = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]


@pytest.mark.parametrize("launcher", [[], TORCHRUN_2], ids=["python", "torchrun"])
def test_ctrl_c_is_one_line_and_status_130(tmp_path, launcher):
    proc = start_training(launcher, "--checkpoint-dir", tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C; torchrun passes it on
        _, err = proc.communicate(timeout=30)
    finally:
        finish(proc, 0)
    line = "train.py: interrupted: the same command resumes from the last checkpoint\n"
    if launcher:  # torchrun itself says more, and exits 1
        assert err.count(line) == 1 and f'File "{TRAIN}"' not in err, err
    else:
        assert (proc.returncode, err) == (130, line)


def test_workers_end_with_a_killed_torchrun():
    proc = start_training(TORCHRUN_2)
    workers = psutil.Process(proc.pid).children()
    try:
        assert len(workers) == 2
        proc.kill()
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers left running: {alive}"
    finally:
        finish(proc, 0)
        for worker in workers:
            if worker.is_running():
                worker.kill()


def test_a_rank_that_fails_ends_the_job_at_once_with_its_traceback(tmp_path):
    # Rank 1 fails at its third step while rank 0 waits in that step's all-reduce, and its
    # process group's teardown would hang, as nccl's may: it must leave without it.
    patch = """import time
import torch.distributed as dist
if os.environ["RANK"] == "1":
    step, calls = train.train_step, []
    def failing_step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("the cause")
        return step(*args)
    train.train_step = failing_step
    dist.destroy_process_group = lambda: time.sleep(60)
"""
    started = time.monotonic()
    result = torchrun(2, "--arch", "cnn", "--dataset", "synthetic", "--timeout", "60",
                      script=patched_train(tmp_path, patch), timeout=90)
    assert result.returncode != 0 and "ValueError: the cause" in result.stderr
    assert time.monotonic() - started < 40  # no rank waited out --timeout


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        self.server.requests.append(self.path)


def test_one_rank_downloads_on_each_node_while_the_others_wait(mnist_dir, tmp_path):
    """Two nodes of two ranks, sharing no disk, download from a mirror on loopback that serves
    the tiny MNIST, gzipped as MNIST's mirrors do."""
    served = tmp_path / "mirror"
    served.mkdir()
    for name in train.MNIST_FILES:
        (served / f"{name}.gz").write_bytes(gzip.compress((mnist_dir / "MNIST" / "raw" / name)
                                                           .read_bytes()))
    with http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: QuietFiles(
            *a, directory=str(served))) as mirror:
        mirror.requests = []
        threading.Thread(target=mirror.serve_forever, daemon=True).start()
        patch = f"""def download(args):
    import torchvision
    torchvision.datasets.MNIST.mirrors = ['http://127.0.0.1:{mirror.server_port}/']
    torchvision.datasets.MNIST.resources = [(n + '.gz', None) for n in train.MNIST_FILES]
    with open({str(tmp_path / "downloaders")!r}, "a") as f:
        f.write(os.environ["RANK"] + " ")
    train.download_mnist(args)
train.DATASETS["mnist"] = (download, *train.DATASETS["mnist"][1:])"""
        said = two_nodes(2, patched_train(tmp_path, patch), "--arch", "cnn", "--batch-size", "16",
                         "--max-steps", "2", "--data", lambda node: tmp_path / node)
        mirror.shutdown()
    assert "done: step 2/2" in said
    assert sorted((tmp_path / "downloaders").read_text().split()) == ["0", "2"]  # node b: 2, 3
    assert set(mirror.requests) == {f"/{name}.gz" for name in train.MNIST_FILES}


def test_the_readmes_example_of_your_own_data_and_model_trains(tmp_path, capfd, monkeypatch):
    """README.md's CIFAR-10 lines, with torchvision's CIFAR10 faked (nothing downloads)."""
    block = (REPO / "README.md").read_text().split("```python\n")[1].split("```")[0]
    code, entries = block.split("# in DATASETS:\n")

    class FakeCIFAR10:  # as torchvision's: HWC uint8 images in .data, a list in .targets
        def __init__(self, root, train, download=False):
            g = torch.Generator().manual_seed(int(train))
            self.data = torch.randint(0, 256, (64, 32, 32, 3), generator=g, dtype=torch.uint8).numpy()
            self.targets = torch.randint(0, 10, (64,), generator=g).tolist()

    monkeypatch.setattr("torchvision.datasets.CIFAR10", FakeCIFAR10)
    namespace = {**vars(train), "MyNet": lambda channels, classes: train.cnn(channels, classes, 32)}
    exec(code, namespace)
    new = eval("{" + entries.replace("# in MODELS (train.py's cnn takes a size too):", "") + "}",
               namespace)
    for name, entry in new.items():
        monkeypatch.setitem(train.DATASETS if name == "cifar10" else train.MODELS, name, entry)
    code, out, err = main_in_process(capfd, "--dataset", "cifar10", "--arch", "mynet",
                                     "--data", tmp_path, "--max-steps", "2", "--batch-size", "16")
    assert code == 0 and "done: step 2/2" in out, err
