"""Data path: samples/s of one epoch of training batches, the model left out, for the
documented pattern's DataLoader against train.py's tensor indexing, on the same files.

An epoch of the pattern starts its 8 workers, decodes each sample through PIL, ToTensor and
Normalize, collates, and (on a GPU) copies each batch to the device. An epoch of train.py
draws its shard order (epoch_order), indexes the uint8 tensor already on the device, and
normalises the batch there. Loading the files into memory happens once per run in both and
is not timed. Target: train.py >= 5x the pattern on CPU, >= 20x on a GPU.
"""
import argparse
import time

from common import (MNIST_TRAIN_SAMPLES, PATTERN_BATCH_SIZE, QUICK_TRAIN_SAMPLES, bench_device,
                    mnist_files, pattern_batches, pattern_loader, print_machine, print_table, sync,
                    train, train_py_data, unwind_on_sigterm, verdict)

TARGET = {"cpu": 5.0, "cuda": 20.0}


def pattern_epoch(loader, device):
    """One epoch of the pattern's batches, on the device; returns the samples seen."""
    return sum(len(y) for _, y in pattern_batches(loader, device))


def train_py_epoch(train_x, train_y, stats, device):
    """One epoch of train.py's batches, as its training loop makes them; returns the samples."""
    order = train.epoch_order(len(train_x), epoch=0, rank=0, world_size=1, seed=0).to(device)
    batches = ((train.normalize(train_x[idx], *stats), train_y[idx])
               for idx in order.split(PATTERN_BATCH_SIZE))
    return sum(len(y) for _, y in batches)


def best_samples_per_sec(epoch, repeats, device):
    """The fastest of `repeats` epochs: the least disturbed by the rest of the machine."""
    best = 0.0
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        samples = epoch()
        sync(device)
        best = max(best, samples / (time.perf_counter() - start))
    return samples, best


def main():
    unwind_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK_TRAIN_SAMPLES:,} samples, one epoch each "
                        "(figures not comparable)")
    args = p.parse_args()
    train_samples, repeats = (QUICK_TRAIN_SAMPLES, 1) if args.quick else (MNIST_TRAIN_SAMPLES, 3)
    device = bench_device()
    print_machine()
    with mnist_files(train_samples) as root:
        loader = pattern_loader(root, device)
        train_x, train_y, stats = train_py_data(root, device)
        paths = (("pattern: DataLoader, 8 workers", lambda: pattern_epoch(loader, device)),
                 ("train.py: tensor indexing",
                  lambda: train_py_epoch(train_x, train_y, stats, device)))
        results = [(name, *best_samples_per_sec(epoch, repeats, device)) for name, epoch in paths]
    print(f"device {device}; batch {PATTERN_BATCH_SIZE}; best of {repeats} epoch(s)")
    print_table(["data path", "samples/epoch", "samples/s"],
                [(name, samples, f"{rate:,.0f}") for name, samples, rate in results])
    ratio = results[1][2] / results[0][2]
    target = TARGET[device.type]
    print(f"ratio train.py / pattern: {ratio:.1f}x (target >= {target:g}x on {device.type}): "
          f"{verdict(ratio, target)}")


if __name__ == "__main__":
    main()
