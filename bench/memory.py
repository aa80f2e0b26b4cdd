"""Memory: peak resident memory of one rank, counting every process the rank owns (its
DataLoader workers included), for train.py against the documented pattern (8 workers).
Target: train.py <= 1/4 of the pattern, on CPU. On a GPU machine too, every run
is on the CPU (CUDA hidden): on a GPU, train.py's data set would leave host memory, and
RSS would count CUDA's libraries instead.

Each runs alone, one process as one rank (a world of one, no torchrun: the launcher is
shared by a node's ranks), the same cnn and the same MNIST-format files, while psutil
samples the process tree. RSS, the target's measure, counts a page shared by several
processes (torch's libraries, the data set a forked worker inherits) once per process;
PSS splits each shared page among its sharers, so the PSS sum is what the rank costs
the machine. Both are shown; the target is stated in RSS and judged on it. A row
that only imports torch and torchvision shows the floor under any PyTorch process.

How the pattern's workers start decides what they share. Forked (Linux's default up to
Python 3.13), they share the parent's torch and data set pages; started by forkserver
(Linux's default from Python 3.14) or spawn (macOS, Windows), each imports torch afresh.
Both are measured; the ratio is judged against this Python's default.
"""
import argparse
import multiprocessing
import os
import sys
import time

import psutil
import torch

from common import (MNIST_TRAIN_SAMPLES, finish, mnist_files, pattern_samples_per_sec,
                    print_machine, print_table, start, train_command, unwind_on_sigterm, verdict)

TARGET = 0.25
STEPS, QUICK_STEPS = 200, 20  # enough for the pattern's 8 workers to fill their prefetch queues
# Seconds between samples of the process tree: each read walks a process's page tables
# (some 10-30 ms for a torch process), and the sampler must not starve what it measures.
SAMPLE_EVERY = 0.25
MIB = 2 ** 20
START_METHODS = ("fork", "forkserver")  # Linux's defaults before and from Python 3.14


def rss_and_pss(pid):
    """(RSS, PSS) in bytes from the kernel's one-line summary of the process's mappings,
    several times cheaper than psutil's memory_full_info, which reads every mapping."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        fields = dict(line.split(":", 1) for line in f if line[0].isupper())
    return tuple(int(fields[key].split()[0]) * 1024 for key in ("Rss", "Pss"))


def tree_memory(root):
    """(RSS sum, PSS sum, process count) of root and all its descendants, now."""
    rss = pss = count = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            proc_rss, proc_pss = rss_and_pss(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            continue  # a worker that exited between the listing and the read
        rss, pss, count = rss + proc_rss, pss + proc_pss, count + 1
    return rss, pss, count


def measure_command(cmd):
    """Peak (RSS sum, PSS sum, process count) of cmd's process tree while it runs. The
    pattern runs this way too, as a script of its own: a process started by multiprocessing's
    spawn would spawn its DataLoader workers as well (each importing torch afresh), where
    the pattern, run by python on Linux, forks them from itself."""
    proc = start(cmd)
    root, peak = psutil.Process(proc.pid), (0, 0, 0)
    while proc.poll() is None:
        peak = tuple(max(a, b) for a, b in zip(peak, tree_memory(root)))
        time.sleep(SAMPLE_EVERY)
    finish(proc, timeout=300)
    return peak


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK_STEPS} steps instead of {STEPS} "
                        "(figures not comparable)")
    # Set by main, to run the pattern as a process of its own.
    p.add_argument("--pattern-rank", metavar="DATA", help=argparse.SUPPRESS)
    p.add_argument("--start-method", choices=START_METHODS, help=argparse.SUPPRESS)
    args = p.parse_args()
    steps = QUICK_STEPS if args.quick else STEPS
    device = torch.device("cpu")
    if args.pattern_rank:
        return pattern_samples_per_sec(args.pattern_rank, "cnn", steps, device, args.start_method)
    unwind_on_sigterm()
    print_machine()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # for every run measured below
    # The full training set even with --quick: its size is what the data paths hold.
    with mnist_files(MNIST_TRAIN_SAMPLES) as root:
        floor = measure_command([sys.executable, "-c", "import torch, torchvision"])
        train_py = measure_command(train_command(root, ["--arch", "cnn", "--max-steps", steps]))
        pattern = {method: measure_command([sys.executable, __file__, "--pattern-rank", root,
                                            "--start-method", method,
                                            *(["--quick"] if args.quick else [])])
                   for method in START_METHODS}
    print(f"device {device}; --arch cnn; {steps} steps; {MNIST_TRAIN_SAMPLES:,} training images")
    default = multiprocessing.get_start_method()
    rows = [("import torch, torchvision (floor)", *floor), ("train.py", *train_py),
            *((f"pattern, 8 workers by {method}{' (default)' if method == default else ''}",
               *pattern[method]) for method in START_METHODS)]
    print_table(["one rank", "processes", "peak RSS sum MiB", "peak PSS sum MiB"],
                [(name, count, f"{rss / MIB:,.0f}", f"{pss / MIB:,.0f}")
                 for name, rss, pss, count in rows])
    rss_ratio, pss_ratio = (train_py[i] / pattern[default][i] for i in (0, 1))
    print(f"ratio train.py / pattern ({default}): RSS {rss_ratio:.2f} (target <= {TARGET}): "
          f"{verdict(rss_ratio, TARGET, at_least=False)}; PSS {pss_ratio:.2f}")


if __name__ == "__main__":
    main()
