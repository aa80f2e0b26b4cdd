"""DDP weak scaling of train.py --arch cnn: 1 process against 2 under torchrun --standalone,
gloo, one thread each, batch 64 per process. Efficiency = thr(2) / (2 * thr(1)), where thr is
the samples/s of all processes together; the physical limit is 1.0, the target >= 0.85.

The headline figure runs train.py itself. Below it, a harness built from train.py's own
functions (data, model, DDP wrapper) times each step's phases on rank 0: data (index and
normalise), forward + backward (which, under DDP, ends by waiting for the gradient
all-reduce), and the optimizer. It runs DDP's options and a process/thread split as
variants; "no all-reduce" steps under no_sync, so the same step without communication
shows how much of the loss is communication and how much is two processes sharing the
machine. On a machine with 2 or more GPUs, train.py also runs with nccl.
"""
import argparse
import contextlib
import json
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (MNIST_TRAIN_SAMPLES, QUICK_TRAIN_SAMPLES, finish, mnist_files, print_machine,
                    print_table, start, train, train_samples_per_sec, verdict)

TARGET = 0.85
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
RESULT = "scaling-harness-result: "  # marks rank 0's line of results in torchrun's output


class Variant(NamedTuple):
    name: str
    batch_size: int = 64
    threads: int = 1
    ddp_options: dict = None  # None: train.wrap_ddp, exactly as train.py wraps its model
    all_reduce: bool = True


TRAIN_PY_DDP = Variant("train.py's DDP")
NO_ALL_REDUCE = Variant("no all-reduce (no_sync)", all_reduce=False)
VARIANTS = {  # by world size
    1: [TRAIN_PY_DDP,
        NO_ALL_REDUCE,
        # Same global batch as 2 processes x 64: the other way to use the second core.
        Variant("1 process x 2 threads, batch 128", batch_size=128, threads=2)],
    2: [TRAIN_PY_DDP,
        NO_ALL_REDUCE,
        Variant("gradient_as_bucket_view=False", ddp_options={"gradient_as_bucket_view": False}),
        Variant("static_graph=True", ddp_options={"gradient_as_bucket_view": True,
                                                  "static_graph": True}),
        # The cnn's gradients are 82 KB, one bucket by default; ~20 KB buckets let the
        # fc layer's all-reduce start while the convolutions' backward still runs.
        Variant("bucket_cap_mb=0.02", ddp_options={"gradient_as_bucket_view": True,
                                                   "bucket_cap_mb": 0.02})],
}
PHASES = ("data", "forward+backward", "optimizer")


# ------------------------------------------------------------------------ harness (torchrun worker)

def wrap(model, variant, device):
    if variant.ddp_options is None:
        return train.wrap_ddp(model, device)
    return DDP(model, **variant.ddp_options)


def phase_ms(variant, train_x, train_y, order, steps, warmup, device):
    """Mean milliseconds per step of each phase of `variant`, over `steps` steps after
    `warmup` untimed ones (DDP settles its buckets in the first steps)."""
    torch.set_num_threads(variant.threads)
    torch.manual_seed(0)
    ddp_model = wrap(train.build_model("cnn").to(device), variant, device)
    dist.barrier()  # every rank starts the variant together
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.01, momentum=0.9)  # as train.py
    totals = dict.fromkeys(PHASES, 0.0)
    batches = order.split(variant.batch_size)[:warmup + steps]
    for i, idx in enumerate(batches):
        t0 = time.perf_counter()
        x, y = train.normalize(train_x[idx]), train_y[idx]
        t1 = time.perf_counter()
        with contextlib.nullcontext() if variant.all_reduce else ddp_model.no_sync():
            F.cross_entropy(ddp_model(x), y).backward()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        if i >= warmup:
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2)):
                totals[phase] += seconds
    return {phase: 1000 * seconds / steps for phase, seconds in totals.items()}


def all_reduce_ms(num_elements, calls=100):
    """Milliseconds per all-reduce of a flat fp32 tensor of the model's size."""
    flat = torch.zeros(num_elements)
    for _ in range(5):
        dist.all_reduce(flat)
    start_time = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(flat)
    return 1000 * (time.perf_counter() - start_time) / calls


def harness(root, quick):
    """Run every variant of this world size; rank 0 prints the results as one JSON line."""
    args = train.parse_args(["--arch", "cnn", "--dataset", "mnist", "--data", root,
                             "--no-download", "--backend", "gloo"])
    rank, local_rank, world_size, device = train.setup_distributed(args)
    torch.set_flush_denormal(True)  # as train.train does on CPU
    train_x, train_y, _, _ = train.build_data(args, rank, local_rank, device)
    order = train.epoch_order(len(train_x), 0, rank, world_size, seed=0)
    steps, warmup = (5, 2) if quick else (150, 10)
    results = {"variants": {}}
    for variant in VARIANTS[world_size]:
        results["variants"][variant.name] = phase_ms(variant, train_x, train_y, order, steps,
                                                     warmup, device)
    torch.set_num_threads(1)
    num_params = sum(p.numel() for p in train.build_model("cnn").parameters())
    results["all_reduce"] = {"elements": num_params, "ms": all_reduce_ms(num_params)}
    if rank == 0:
        print(RESULT + json.dumps(results), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver

def run_harness(root, nproc, quick):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", __file__, "--worker", root] + (["--quick"] if quick else [])
    out = finish(start(cmd, ONE_THREAD), timeout=300)
    line = next(line for line in out.splitlines() if line.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def samples_per_sec(variant, ms, world_size):
    return variant.batch_size * world_size * 1000 / sum(ms.values())


def print_headline(root, steps, backend, env):
    """train.py itself on 1 and 2 processes; returns the efficiency."""
    flags = ["--arch", "cnn", "--backend", backend, "--max-steps", steps]
    thr = {n: train_samples_per_sec(root, flags, nproc=n, env=env) for n in (1, 2)}
    print(f"\ntrain.py --arch cnn --backend {backend}, batch 64 per process, {steps} steps"
          f"{', 1 thread per process' if env else ''}")
    print_table(["processes", "samples/s (all)", "samples/s per process"],
                [(n, f"{thr[n]:,.0f}", f"{thr[n] / n:,.0f}") for n in thr])
    return thr[2] / (2 * thr[1])


def print_harness(root, quick):
    results = {n: run_harness(root, n, quick) for n in VARIANTS}
    ms = {(n, v.name): results[n]["variants"][v.name] for n in VARIANTS for v in VARIANTS[n]}
    thr = {(n, v.name): samples_per_sec(v, ms[n, v.name], n) for n in VARIANTS for v in VARIANTS[n]}
    one_core = thr[1, TRAIN_PY_DDP.name]
    rows = [(v.name, f"{n} x {v.threads}", v.batch_size,
             *(f"{ms[n, v.name][p]:.2f}" for p in PHASES), f"{sum(ms[n, v.name].values()):.2f}",
             f"{thr[n, v.name]:,.0f}",
             f"{thr[n, v.name] / (2 * one_core):.2f}" if n * v.threads == 2 else "-")
            for n in VARIANTS for v in VARIANTS[n]]
    print("\nwhere the time goes: ms per step on rank 0 (harness on train.py's functions, gloo); "
          "efficiency of the rows on 2 cores against 2x the first row")
    print_table(["variant", "procs x threads", "batch", *PHASES, "step", "samples/s (all)",
                 "efficiency"], rows)
    exposed = (ms[2, TRAIN_PY_DDP.name]["forward+backward"]
               - ms[2, NO_ALL_REDUCE.name]["forward+backward"])
    reduce = results[2]["all_reduce"]
    print(f"all-reduce of the cnn's {reduce['elements']:,} fp32 gradients on 2 processes: "
          f"{reduce['ms']:.2f} ms a call; exposed in train.py's step: {exposed:.2f} ms")
    compute_only = thr[2, NO_ALL_REDUCE.name] / (2 * thr[1, NO_ALL_REDUCE.name])
    print(f"efficiency without any all-reduce (no_sync, 2 vs 1): {compute_only:.2f}; "
          "below 1.0, the two processes slow each other down (shared cores, caches, memory)")

def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: a few steps (figures not comparable)")
    p.add_argument("--worker", metavar="DATA", help=argparse.SUPPRESS)  # set by run_harness
    args = p.parse_args()
    if args.worker:
        return harness(args.worker, args.quick)
    print_machine()
    steps = 10 if args.quick else 300
    with mnist_files(QUICK_TRAIN_SAMPLES if args.quick else MNIST_TRAIN_SAMPLES) as root:
        efficiency = print_headline(root, steps, "gloo", ONE_THREAD)
        print_harness(root, args.quick)
        if torch.cuda.device_count() >= 2:
            print(f"nccl: efficiency {print_headline(root, steps, 'nccl', None):.2f}")
        else:
            print(f"nccl: not run: 2 processes need 2 GPUs, torch sees {torch.cuda.device_count()}")
    print(f"efficiency thr(2) / (2 thr(1)) of train.py, gloo: {efficiency:.2f} "
          f"(target >= {TARGET}): {verdict(efficiency, TARGET)}")


if __name__ == "__main__":
    main()
