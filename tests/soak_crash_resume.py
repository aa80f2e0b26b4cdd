"""Kill train.py at random moments, rerun the same command each time, and check that the run
ends bitwise equal to one never stopped. pytest does not collect it (it takes minutes):

    python tests/soak_crash_resume.py [--trials 4] [--arch cnn] [--seed 0]

Three ranks under torchrun --standalone, on the CPU, save after every step. Each kill is one
of: a machine's crash (SIGKILL to torchrun and its workers), a worker's kill -9 (torchrun
stops the others), SIGTERM to torchrun, or a kill -9 of torchrun alone (its workers end
with it). It also counts the kills that left a process of the run behind (torchrun's gaps,
in docs/multi-node.md's "Without launch.sh"), and kills those. Exits 1 unless every trial is exact."""
import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from conftest import HIDDEN_GPUS, TINY, TRAIN, load, write_tiny_mnist

KILLS = ["crash", "worker", "sigterm", "kill -9 torchrun"]


def start(train_args, checkpoint_dir):
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
         TRAIN, *train_args, "--checkpoint-dir", checkpoint_dir],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, **HIDDEN_GPUS, "OMP_NUM_THREADS": "1"})


def processes_of(checkpoint_dir):
    """The run's processes, found by their command line: workers torchrun lost track of too."""
    return [p for p in psutil.process_iter(["cmdline"])
            if str(checkpoint_dir) in " ".join(p.info["cmdline"] or [])]


def kill(processes):
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def run_with_kills(train_args, checkpoint_dir, seconds, rng):
    """Rerun until a run ends by itself; return (its exit status, stderr, kills, left)."""
    kills, left = [], 0
    while True:
        torchrun = start(train_args, checkpoint_dir)
        delay = rng.uniform(0.3, seconds)
        try:
            _, err = torchrun.communicate(timeout=delay)
            return torchrun.returncode, err, kills, left
        except subprocess.TimeoutExpired:
            pass
        workers = psutil.Process(torchrun.pid).children()
        how = rng.choice(KILLS if workers else [k for k in KILLS if k != "worker"])
        if how == "crash":
            kill([psutil.Process(torchrun.pid), *workers])
        elif how == "worker":
            kill([rng.choice(workers)])
        elif how == "sigterm":
            torchrun.terminate()
        else:
            torchrun.kill()
        try:
            torchrun.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a worker torchrun lost track of holds stderr
            torchrun.kill()
        deadline = time.monotonic() + 5
        while (behind := processes_of(checkpoint_dir)) and time.monotonic() < deadline:
            time.sleep(0.2)
        if behind:
            left += 1
            kill(behind)
        torchrun.wait()
        kills.append(f"{how} at {delay:.1f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=4, help="runs to kill until they end")
    p.add_argument("--arch", choices=["cnn", "resnet18"], default="cnn")
    p.add_argument("--seed", type=int, default=0, help="of the kills' moments and kinds")
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="soak_crash_resume."))
    data = write_tiny_mnist(root / "data")
    train_args = [*TINY, "--arch", args.arch, "--data", data, "--accum-steps", "2",
                  "--save-every", "1", "--epochs", "3" if args.arch == "cnn" else "1"]
    start_time = time.monotonic()
    never_stopped = start(train_args, root / "never_stopped")
    _, err = never_stopped.communicate(timeout=300)
    seconds = time.monotonic() - start_time
    if never_stopped.returncode != 0:
        sys.exit(f"the run never stopped failed:\n{err}")
    whole = load(root / "never_stopped" / "last.pt")
    print(f"never stopped: {seconds:.1f} s, {whole['step']} steps", flush=True)
    rng, exact = random.Random(args.seed), 0
    for trial in range(args.trials):
        status, err, kills, left = run_with_kills(train_args, root / str(trial), seconds, rng)
        end = load(root / str(trial) / "last.pt") if status == 0 else None
        same = end is not None and end["step"] == whole["step"] and all(
            torch.equal(end["model"][k], whole["model"][k]) for k in whole["model"]) and all(
            torch.equal(a["momentum_buffer"], b["momentum_buffer"]) for a, b in
            zip(end["optimizer"]["state"].values(), whole["optimizer"]["state"].values()))
        exact += same
        print(f"trial {trial}: {'exact' if same else f'NOT EXACT (exit {status})'} after "
              f"{len(kills)} kills, {left} of which left a process: {'; '.join(kills)}", flush=True)
        if status != 0:
            print(err[-2000:])
    print(f"{exact} of {args.trials} trials exact")
    if exact < args.trials:
        sys.exit(f"the runs' files are in {root}")
    shutil.rmtree(root)


if __name__ == "__main__":
    main()
