"""What the bench scripts share: train.py itself, MNIST-format files written on the spot,
the documented pattern's data path and training step, child processes, and the printout.

The documented pattern is the torchrun + DDP MNIST tutorial that train.py replaces, fixed
just enough to run: torchvision's MNIST with per-sample ToTensor + Normalize((0.5,), (0.5,)),
a DataLoader with 8 workers and a DistributedSampler, and plain SGD at lr 0.01.
"""
import contextlib
import datetime
import importlib
import json
import os
import platform
import re
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
TRAIN = REPO / "train.py"
sys.path.insert(0, str(REPO))
import train  # noqa: E402  (the benchmarks measure train.py's own functions, not copies)

MNIST_TRAIN_SAMPLES = 60_000
QUICK_TRAIN_SAMPLES = 6_400  # --quick: enough for a smoke run, too few for a figure
PATTERN_BATCH_SIZE = 64
PATTERN_WORKERS = 8
TEST_SAMPLES = 1000  # train.py evaluates after its steps; a small test set keeps that short


# ----------------------------------------------------------------------------- machine

def bench_device():
    """Where the benchmarks run: the GPU when there is one, as train.py's --backend auto does."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


def sync(device):
    """Wait for the GPU, so that a timer read next covers the work queued before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def print_machine():
    """One line that says where and when the figures below were taken, for the README table."""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"machine: {os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {gpu}, "
          f"torch {torch.__version__}, python {platform.python_version()}; {now}", flush=True)


# ----------------------------------------------------------------------------- data

def write_idx(path, tensor):
    """Write a uint8 tensor in MNIST's idx format (magic 0x08, then the dimensions)."""
    header = struct.pack(">HBB", 0, 0x08, tensor.dim())
    header += b"".join(struct.pack(">I", d) for d in tensor.shape)
    path.write_bytes(header + tensor.numpy().tobytes())


@contextlib.contextmanager
def mnist_files(train_samples):
    """A temporary directory with MNIST's four files in torchvision's layout (MNIST/raw), of
    train.py's synthetic images, so that nothing downloads and both data paths read the
    same bytes."""
    with tempfile.TemporaryDirectory(prefix="bench-mnist-") as root:
        raw = Path(root) / "MNIST" / "raw"
        raw.mkdir(parents=True)
        data = train.synthetic(sizes=(train_samples, TEST_SAMPLES))
        for name, tensor in zip(train.MNIST_FILES, data):
            write_idx(raw / name, (tensor[:, 0] if tensor.dim() == 4 else tensor).to(torch.uint8))
        yield root


def train_py_data(root, device):
    """train.py's training set, loaded as train.py loads it (uint8 tensors on the device, in a
    process group of one where there is none), and its mean and std."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    args = train.parse_args(["--dataset", "mnist", "--data", root, "--no-download"])
    (train_x, train_y, _, _), stats = train.build_data(args, device)
    return train_x, train_y, stats


# ----------------------------------------------------------------------------- the pattern

def pattern_loader(root, device, start_method=None):
    """The documented pattern's DataLoader over the MNIST files under root; its workers
    start by multiprocessing's default method unless start_method names another."""
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from torchvision import datasets, transforms

    dataset = datasets.MNIST(root, train=True, download=False, transform=transforms.Compose(
        [transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))]))
    # The warning that 8 workers oversubscribe a small machine is the point of the comparison.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    # One replica: the per-process cost, which is what a rank pays under torchrun.
    # pin_memory only means something with CUDA, and warns without it.
    return DataLoader(dataset, batch_size=PATTERN_BATCH_SIZE, shuffle=False,
                      num_workers=PATTERN_WORKERS, pin_memory=device.type == "cuda",
                      sampler=DistributedSampler(dataset, num_replicas=1, rank=0),
                      multiprocessing_context=start_method)


def pattern_batches(loader, device):
    """The pattern's batches on the device: its host-to-device copy is part of its data path."""
    for x, y in loader:
        yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def pattern_samples_per_sec(root, arch, steps, device, start_method=None):
    """Samples/s of the pattern's training step (DataLoader + model + SGD, fp32, no DDP, as
    train.py runs a world of one). The first step, which waits for 8 workers to start, is
    not timed: a steady-state figure, which favours the pattern."""
    torch.manual_seed(0)
    model = train.MODELS[arch](1, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = pattern_batches(pattern_loader(root, device, start_method), device)
    samples, start = 0, None
    for step, (x, y) in zip(range(steps + 1), batches):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step == 0:
            sync(device)
            start = time.perf_counter()
        else:
            samples += len(y)
    sync(device)
    return samples / (time.perf_counter() - start)


# ----------------------------------------------------------------------------- processes

def start(cmd, env=None):
    """Start cmd in a session of its own, so that it and every process it starts
    (torchrun's workers, DataLoader workers) can be killed together."""
    return subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={**os.environ, **(env or {})})


def finish(proc, timeout):
    """Wait for a process from start(); return its output, or exit with it on failure.
    Nothing of the process group survives, even when the leader exited first."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        sys.exit(f"timed out after {timeout} s: {' '.join(proc.args)}\n{out[-3000:]}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode != 0:
        sys.exit(f"exit {proc.returncode}: {' '.join(proc.args)}\n{out[-3000:]}")
    return out


def train_command(root, flags, nproc=None):
    """train.py on the MNIST files under root: one process with python, or nproc under
    torchrun --standalone."""
    launcher = [sys.executable] if nproc is None else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return [*launcher, TRAIN, "--dataset", "mnist", "--data", root, "--no-download",
            "--epochs", "1", *flags]


def train_samples_per_sec(root, flags, nproc=None, env=None, timeout=300):
    """samples_per_sec from train.py's --metrics: all ranks' samples over the training loop's
    seconds, which leave out start-up and evaluation."""
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        finish(start(train_command(root, [*flags, "--metrics", metrics], nproc), env), timeout)
        return json.loads(metrics.read_text().splitlines()[-1])["samples_per_sec"]


# ----------------------------------------------------------------------------- printout

def print_table(headers, rows):
    """Columns sized to their widest cell; the first column left-aligned, numbers right."""
    cells = [list(headers)] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(row, widths))).rstrip())


def verdict(value, target, at_least=True):
    met = value >= target if at_least else value <= target
    return "meets the target" if met else "MISSES the target"


# ----------------------------------------------------------------------------- launch.sh, cluster
# For launch_latency.py and teardown.py: launch.sh on tests/cluster.py's
# simulated cluster, started as tests/test_launch.py starts it.

LAUNCH = REPO / "launch.sh"
# train.py until stopped, with a line from rank 0 after every step.
LONG_TRAIN = ["train.py", "--arch", "cnn", "--dataset", "synthetic", "--epochs", "1000",
              "--log-every", "1"]


def tests_module(name):
    """The module tests/NAME.py (cluster, conftest), reused rather than copied."""
    if str(REPO / "tests") not in sys.path:
        sys.path.insert(0, str(REPO / "tests"))
    return importlib.import_module(name)


def simulated_cluster(n_hosts):
    """tests/cluster.py's simulated_cluster(n_hosts), a context manager: network namespaces
    with a real sshd each, removed on exit. Needs root, iproute2, util-linux, openssh-server,
    openssl, and pytest (which cluster.py imports); exits with the reason when one is missing."""
    cluster = tests_module("cluster")
    missing = cluster.missing_prerequisites()
    if missing:
        sys.exit("simulated cluster unavailable: " + "; ".join(missing))
    return cluster.simulated_cluster(n_hosts)


def unwind_on_sigterm():
    """End the run on SIGTERM (timeout(1)'s, say) by unwinding, so that what it started
    is stopped and removed (finish()'s child processes, temporary files, the simulated
    cluster) rather than left behind by Python's default death."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def limit_run_time(seconds):
    """unwind_on_sigterm(), and end the run the same way after `seconds` at the latest."""
    def too_long(*_):
        raise TimeoutError(f"{Path(sys.argv[0]).name} ran past its own limit of {seconds} s")
    unwind_on_sigterm()
    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(seconds)


def clock():
    """Seconds on CLOCK_BOOTTIME, the clock that /proc/PID/stat's start times count on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def proc_stat(pid):
    """(start time on clock(), CPU seconds used so far, session id) of pid; None once it is gone.
    Start times have the kernel's tick resolution (10 ms at the usual 100 Hz)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")  # fields[0] is field 3 of proc(5): state
    return int(fields[19]) / tick, (int(fields[11]) + int(fields[12])) / tick, int(fields[3])


def is_worker(argv):
    """A training process (train.py, not the torchrun that runs it)."""
    return "train.py" in argv and not any(a.endswith("torchrun") for a in argv)


def is_torchrun(argv):
    return any(a.endswith("torchrun") for a in argv)


class Launched:
    """launch.sh [OPTIONS] HOSTFILE NPROC SCRIPT_ARGS on the simulated cluster's hosts (logs
    under tmp/logs), started as the tests start it: this python's torchrun first on PATH,
    OMP_NUM_THREADS=1, SSH_COMMAND for the cluster, in a session of its own with SIGINT at
    its default disposition, as a terminal's foreground job has it.
    Every line of its stdout and stderr is kept with the clock() time it arrived here.
    As a context manager, it leaves nothing running: the session is killed, then whatever
    is left on the cluster's hosts."""

    def __init__(self, cluster, hosts, nproc, script_args, tmp, options=(), launch=LAUNCH):
        self.cluster = cluster
        hostfile = cluster.write_hostfile(Path(tmp) / "hosts.txt", hosts)
        # Every process launch.sh starts here carries the mark, also in a session of its own.
        mark = os.urandom(8).hex()
        self.mark = f"BENCH_LAUNCH={mark}".encode()
        # cluster.env() hides the GPUs, as the tests do: the simulated hosts share this
        # machine's, where nccl would put every one of them on GPU 0.
        env = cluster.env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                          OMP_NUM_THREADS="1", BENCH_LAUNCH=mark)
        self.lines, self.done = [], False
        self._changed = threading.Condition()
        self.started = clock()
        self.proc = subprocess.Popen(
            [launch, "--log-dir", Path(tmp) / "logs", *map(str, options), hostfile, str(nproc),
             *map(str, script_args)],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, preexec_fn=tests_module("conftest").default_sigint)
        self.pid = self.proc.pid
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append((clock(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self.done = True
            self._changed.notify_all()

    def processes(self):
        """Pids of launch.sh and what it started here: its ssh clients, say."""
        return tests_module("cluster").launched_processes(self.pid, self.mark)

    def output(self, last=40):
        return "\n".join(line for _, line in self.lines[-last:])

    def wait_for(self, pattern, timeout):
        """clock() time at which the first line matching pattern arrived; RuntimeError if
        launch.sh ends its output or timeout seconds pass first."""
        deadline, regex, seen = time.monotonic() + timeout, re.compile(pattern), 0
        with self._changed:
            while True:
                for arrived, line in self.lines[seen:]:
                    if regex.search(line):
                        return arrived
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if self.done or left <= 0:
                    why = "launch.sh ended" if self.done else f"no line after {timeout} s"
                    raise RuntimeError(f"{why} waiting for {pattern!r}:\n{self.output()}")
                self._changed.wait(min(left, 1.0))

    def stop(self):
        """SIGKILL launch.sh's session, then every process left on the cluster's hosts."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for pid in self.processes():  # one that left the process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self._reader.join(timeout=5)
        for host in self.cluster.hosts:
            self.cluster.kill_all(host)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
