"""Shared helpers for the tests: run a command with a hard timeout, and tiny MNIST files."""
import contextlib
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "train.py"
# The tests are of the CPU and gloo path. On a GPU machine, torch would pick nccl, which
# gives no two ranks the same GPU, so the runs the tests start see no GPU.
HIDDEN_GPUS = {"CUDA_VISIBLE_DEVICES": ""}
# train.py on the tiny MNIST of mnist_dir (add --data): a run of a few steps on 2 ranks takes
# a quarter less CPU than on the synthetic set's 70,000 samples (measured 13.4 vs 18.3 CPU-s).
TINY = ["--arch", "cnn", "--dataset", "mnist", "--no-download", "--batch-size", "16"]


def pytest_configure(config):
    # A SIGTERM (timeout(1), a CI runner cancelling) unwinds like Ctrl-C, so that the
    # fixtures still stop what they started: launchers, sshds, network namespaces.
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        signal.signal(signal.SIGTERM, stop_workers_then_self)
    else:
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def stop_workers_then_self(signum, frame):
    """pytest-xdist's controller runs no test: the fixtures live in its workers, which a
    SIGTERM to the controller alone would never reach (it kills them after 10 s)."""
    for worker in psutil.Process().children():
        with contextlib.suppress(psutil.NoSuchProcess):
            worker.send_signal(signal.SIGTERM)
    signal.default_int_handler(signum, frame)


def default_sigint():
    """For a Popen's preexec_fn: SIGINT at its default disposition, as a terminal's foreground
    job has it. pytest started as a background job of a non-interactive shell (as by some CI
    runners) ignores SIGINT, and so would all it starts: bash cannot even trap it then.
    (`env --default-signal=INT` would do, but needs coreutils 8.31: RHEL 8 has 8.30.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def linux_only(needs):
    """Skips a test off Linux: on a Mac laptop, say, the rest of the suite runs."""
    return pytest.mark.skipif(sys.platform != "linux", reason=f"needs Linux: {needs}")


def skip_or_fail(reason, required_by="REQUIRE_CLUSTER_TESTS"):
    """Skip the calling test, or fail it where the variable required_by is 1: there a skip
    would hide a broken set-up (.ci/run sets REQUIRE_CLUSTER_TESTS; GPU runs set
    REQUIRE_GPU_TESTS)."""
    if os.environ.get(required_by) == "1":
        pytest.fail(f"{reason} ({required_by}=1)")
    pytest.skip(reason)


def run(cmd, timeout=120, gpus=False, **kwargs):
    """Run cmd in its own process group; on timeout stop the whole group and fail the test,
    so a hang (torchrun and all of its workers) never outlives the test. The GPUs stay
    hidden unless gpus=True."""
    hidden = {} if gpus else HIDDEN_GPUS
    env = {**os.environ, "OMP_NUM_THREADS": "1", **hidden, **kwargs.pop("env", {})}
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # launchers stop their remote nodes on SIGTERM
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"timed out after {timeout}s: {cmd}\n{out}\n{err}")
    finally:
        try:  # leave no stray worker behind, even when the launcher exited first
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def assert_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


def load(path):
    """A checkpoint train.py wrote, on the CPU."""
    return torch.load(path, map_location="cpu", weights_only=True)


def metrics(path):
    """The rows of a --metrics file."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def torchrun(nproc, *args, script=TRAIN, **kwargs):
    """train.py (or `script`) under torchrun --standalone, which picks a free port itself."""
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={nproc}", script, *args], **kwargs)


def write_idx(path, tensor):
    """Write a uint8 tensor in MNIST's idx format (magic 0x08, then the dimensions)."""
    header = struct.pack(">HBB", 0, 0x08, tensor.dim())
    header += b"".join(struct.pack(">I", d) for d in tensor.shape)
    path.write_bytes(header + tensor.numpy().tobytes())


@pytest.fixture(scope="session")
def mnist_dir(tmp_path_factory):
    """write_tiny_mnist's files, written once for the whole session."""
    return write_tiny_mnist(tmp_path_factory.mktemp("data"))


def write_tiny_mnist(root):
    """A tiny MNIST in torchvision's layout under root: 512 training and 101 (odd) test
    images. Returns root, for --data."""
    sys.path.insert(0, str(REPO))
    from train import MNIST_FILES, synthetic
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    train_x, train_y, test_x, test_y = synthetic(sizes=(512, 101))
    for name, tensor in zip(MNIST_FILES, (train_x[:, 0], train_y, test_x[:, 0], test_y)):
        write_idx(raw / name, tensor.to(torch.uint8))
    return root
