"""Whole-step throughput: samples/s per process of train.py itself (--arch cnn and resnet18,
run as a child process and read from its --metrics) against the same step written as in the
documented pattern (DataLoader with 8 workers + the same model + SGD, fp32). On a GPU,
train.py also runs with --amp bf16.

One process, the machine's default threads, batch 64. Both figures leave out the first
step, which pays one-off costs: the pattern's waits for its 8 workers to start, train.py's
for the kernels' first use (train.py's time for STEPS + 1 steps less its time for 1). On a
GPU, but for --quick, train.py's second epoch is timed instead, and the pattern runs an
epoch. No target is set here: the ratio is for comparison.
"""
import argparse

from common import (MNIST_TRAIN_SAMPLES, PATTERN_BATCH_SIZE, QUICK_TRAIN_SAMPLES, bench_device,
                    mnist_files, pattern_samples_per_sec, print_machine, print_table,
                    train_samples_per_sec, unwind_on_sigterm)

STEPS = {"cnn": 300, "resnet18": 40}  # sized for the whole run to take under 2 minutes on 2 cores
QUICK_STEPS = {"cnn": 10, "resnet18": 3}
EPOCHS_TIMEOUT = 90  # s, for a GPU run of 2 epochs (estimated at 15 to 25 s; not yet measured)


def keep(rows, row):
    """Add row to the table, and print it at once: a run stopped at its time limit (gpu.sh's)
    still shows what it measured."""
    rows.append(row)
    print("measured:", "  ".join(row), flush=True)


def after_the_first_step(root, flags, steps):
    """train.py's samples/s over its steps 2 to steps + 1: the training loop's seconds for
    steps + 1 steps less its seconds for 1."""
    seconds = [PATTERN_BATCH_SIZE * n / train_samples_per_sec(root, [*flags, "--max-steps", n])
               for n in (1, steps + 1)]
    return PATTERN_BATCH_SIZE * steps / (seconds[1] - seconds[0])


def main():
    unwind_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK_STEPS['cnn']} steps of the cnn and "
                        f"{QUICK_STEPS['resnet18']} of resnet18 (figures not comparable)")
    args = p.parse_args()
    steps, train_samples = ((QUICK_STEPS, QUICK_TRAIN_SAMPLES) if args.quick
                            else (STEPS, MNIST_TRAIN_SAMPLES))
    device = bench_device()
    whole_epochs = device.type == "cuda" and not args.quick
    if whole_epochs:
        batches = -(-train_samples // PATTERN_BATCH_SIZE)  # the last one short
        steps = dict.fromkeys(STEPS, batches - 1)  # after the first
    amps = ["none", "bf16"] if device.type == "cuda" else ["none"]
    print_machine()
    rows, train_py, pattern = [], {}, {}
    with mnist_files(train_samples) as root:
        for arch in steps:
            for amp in amps:
                flags = ["--arch", arch, "--amp", amp]
                if whole_epochs:  # the last --epochs wins; the last row is epoch 2's
                    train_py[arch, amp] = train_samples_per_sec(root, [*flags, "--epochs", "2"],
                                                                timeout=EPOCHS_TIMEOUT)
                    timed = "epoch 2"
                else:
                    train_py[arch, amp] = after_the_first_step(root, flags, steps[arch])
                    timed = f"{steps[arch]} steps after the first"
                keep(rows, (f"train.py --arch {arch} --amp {amp}", timed,
                            f"{train_py[arch, amp]:,.0f}"))
            pattern[arch] = pattern_samples_per_sec(root, arch, steps[arch], device)
            keep(rows, (f"pattern {arch}, fp32", f"{steps[arch]} steps after the first",
                        f"{pattern[arch]:,.0f}"))
    print(f"device {device}; batch 64; one process")
    print_table(["step", "timed", "samples/s"], rows)
    if device.type == "cuda":
        print("samples/s of bf16 / fp32 (train.py; above 1, bf16 is faster): " +
              ", ".join(f"{a} {train_py[a, 'bf16'] / train_py[a, 'none']:.2f}x" for a in steps))
    print("ratio train.py / pattern (fp32): " +
          ", ".join(f"{a} {train_py[a, 'none'] / pattern[a]:.2f}x" for a in steps) +
          " (no target is set for whole steps)")


if __name__ == "__main__":
    main()
