"""DDP weak scaling of train.py --arch cnn: 1 process against 2, gloo, one thread each,
batch 64 per process. Efficiency = thr(2) / (2 * thr(1)), where thr is the samples/s of all
processes together; the physical limit is 1.0, the target >= 0.85.

The speed of a shared VM drifts: on the 2-CPU development VM, one process alone ran at
anywhere from 2,200 to 4,500 samples/s from one minute to the next, so a 1-process run and
a 2-process run taken one after the other gave efficiencies from 0.53 to 1.19 there. So:

1. train.py itself runs under torchrun --standalone with 1 and with 2 processes, several
   rounds in turn; the efficiency of each round, their median and range are printed.
2. The figure judged against the target comes from a harness built from train.py's own
   functions (data, model, DDP wrapper), in one 2-process torchrun. Blocks of 5 steps of
   every variant take turns, round after round, so that each 2-process block is compared
   with a 1-process block run a fraction of a second earlier (rank 1 waits in a barrier,
   off the CPU, while rank 0 runs alone). A block lasts until both ranks are done. The
   median over rounds is the efficiency. Per
   phase it shows where a step's time goes: data (index and normalise), forward + backward
   (which, under DDP, ends by waiting for the gradient all-reduce), and the optimizer.
   The variants: DDP's options; 1 process x 2 threads; "no all-reduce", which steps under
   no_sync: two processes computing side by side without communicating, the ceiling this
   machine allows; and, without DDP, one all-reduce or a mere barrier after backward,
   which split what DDP costs into the transfer and the ranks waiting for each other.
On a machine with 2 or more GPUs, train.py also runs with nccl.
"""
import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common import (MNIST_TRAIN_SAMPLES, QUICK_TRAIN_SAMPLES, finish, mnist_files, print_machine,
                    print_table, start, train, train_samples_per_sec, unwind_on_sigterm, verdict)

TARGET = 0.85
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
RESULT = "scaling-harness-result: "  # marks rank 0's line of results in torchrun's output


class Variant(NamedTuple):
    name: str
    processes: int = 2  # 1: rank 0 steps alone while rank 1 waits in a barrier
    batch_size: int = 64
    threads: int = 1
    # What becomes of the gradients: "ddp", all-reduced by DDP during backward; "kept",
    # never sent (under no_sync); "all_reduce", no DDP but one dist.all_reduce of their
    # size after backward; "barrier", kept, but the ranks wait for each other after
    # backward, as an all-reduce makes them.
    gradients: str = "ddp"
    ddp_options: dict = None  # None: train.wrap_ddp, exactly as train.py wraps its model

    @property
    def uses_ddp(self):
        return self.processes == 2 and self.gradients in ("ddp", "kept")


ALONE = Variant("1 process (rank 1 idle), no DDP", processes=1, gradients="kept")
TRAIN_PY_DDP = Variant("train.py's DDP")
NO_ALL_REDUCE = Variant("no all-reduce (no_sync): the ceiling", gradients="kept")
ONE_ALL_REDUCE = Variant("no DDP, one all-reduce after backward", gradients="all_reduce")
BARRIER = Variant("no DDP, a barrier after backward", gradients="barrier")
VARIANTS = [
    ALONE,
    # Same global batch as 2 processes x 64: the other way to use the second core.
    Variant("1 process x 2 threads, batch 128", processes=1, batch_size=128, threads=2,
            gradients="kept"),
    TRAIN_PY_DDP,
    NO_ALL_REDUCE,
    ONE_ALL_REDUCE,
    BARRIER,
    Variant("gradient_as_bucket_view=False", ddp_options={"gradient_as_bucket_view": False}),
    Variant("static_graph=True", ddp_options={"gradient_as_bucket_view": True,
                                              "static_graph": True}),
    # The cnn's gradients are 82 KB, one bucket by default; ~20 KB buckets let the fc
    # layer's all-reduce start while the convolutions' backward still runs.
    Variant("bucket_cap_mb=0.02", ddp_options={"gradient_as_bucket_view": True,
                                               "bucket_cap_mb": 0.02}),
]
PHASES = ("data", "forward+backward", "optimizer")


# ------------------------------------------------------------------------ harness (torchrun worker)

class Stepper:
    """One variant's model and optimizer, stepped a block at a time through its own batches."""

    def __init__(self, variant, args, train_x, train_y, stats, order, device):
        self.variant, self.train_x, self.train_y, self.stats = variant, train_x, train_y, stats
        self.batches = order.split(variant.batch_size)[:-1]  # the last one may be short
        self.next_batch = 0
        torch.manual_seed(0)
        model = train.MODELS["cnn"](1, 10).to(device)
        if not variant.uses_ddp:
            self.model = model
        elif variant.ddp_options is None:
            self.model = train.wrap_ddp(model, device)
        else:
            self.model = DDP(model, **variant.ddp_options)
        self.optimizer = train.build_optimizer(self.model, args)
        self.flat_gradients = torch.zeros(sum(p.numel() for p in model.parameters()), device=device)

    def block(self, steps):
        """Mean milliseconds per step of each phase over `steps` steps."""
        torch.set_num_threads(self.variant.threads)
        totals = dict.fromkeys(PHASES, 0.0)
        keep_gradients = self.variant.uses_ddp and self.variant.gradients == "kept"
        for _ in range(steps):
            idx = self.batches[self.next_batch % len(self.batches)]
            self.next_batch += 1
            t0 = time.perf_counter()
            x, y = train.normalize(self.train_x[idx], *self.stats), self.train_y[idx]
            t1 = time.perf_counter()
            with self.model.no_sync() if keep_gradients else contextlib.nullcontext():
                F.cross_entropy(self.model(x), y).backward()
            if self.variant.gradients == "all_reduce":
                dist.all_reduce(self.flat_gradients)
            elif self.variant.gradients == "barrier":
                dist.barrier()
            t2 = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
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
    """Step every variant a block at a time, in turn, for several rounds; rank 0 prints,
    as one JSON line, each variant's per-round block time per step and its own phases."""
    args = train.parse_args(["--arch", "cnn", "--dataset", "mnist", "--data", root,
                             "--no-download", "--backend", "gloo"])
    rank, world_size, device = train.setup_distributed(args)
    torch.set_flush_denormal(True)  # as train.train does on CPU
    (train_x, train_y, _, _), stats = train.build_data(args, device)
    order = train.epoch_order(len(train_x), 0, rank, world_size, seed=0)
    rounds, steps = (2, 3) if quick else (50, 5)
    steppers = [Stepper(v, args, train_x, train_y, stats, order, device) for v in VARIANTS]
    for stepper in steppers:  # untimed: DDP settles its buckets in the first steps
        if rank == 0 or stepper.variant.processes == 2:
            stepper.block(steps)
        dist.barrier()
    results = {"variants": {v.name: [] for v in VARIANTS}}
    for _ in range(rounds):
        for stepper in steppers:
            dist.barrier()  # every block starts with both ranks ready...
            start_time = time.perf_counter()
            phases = stepper.block(steps) if rank == 0 or stepper.variant.processes == 2 else None
            dist.barrier()  # ...and lasts until both are done: the slower rank's time
            step = 1000 * (time.perf_counter() - start_time) / steps
            results["variants"][stepper.variant.name].append({"phases": phases, "step": step})
    torch.set_num_threads(1)
    num_params = steppers[0].flat_gradients.numel()
    results["all_reduce"] = {"elements": num_params, "ms": all_reduce_ms(num_params)}
    if rank == 0:
        print(RESULT + json.dumps(results), flush=True)
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- driver

def run_harness(root, quick):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           __file__, "--worker", root] + (["--quick"] if quick else [])
    out = finish(start(cmd, ONE_THREAD), timeout=300)
    line = next(line for line in out.splitlines() if line.startswith(RESULT))
    return json.loads(line[len(RESULT):])


def median_and_range(values):
    return f"{statistics.median(values):.2f} ({min(values):.2f} to {max(values):.2f})"


def spread(values):
    """'median (q1 to q3)' of values: the middle half of them lies in the brackets."""
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return f"{median:.2f} ({q1:.2f} to {q3:.2f})"


def print_train_py(root, rounds, run_flags, backend, env):
    """train.py itself, with run_flags (how long), 1 and 2 processes in turn for `rounds`
    rounds; returns the efficiency of each round."""
    flags = ["--arch", "cnn", "--backend", backend, *run_flags]
    rows, efficiencies = [], []
    for round_number in range(1, rounds + 1):
        thr = {n: train_samples_per_sec(root, flags, nproc=n, env=env) for n in (1, 2)}
        efficiencies.append(thr[2] / (2 * thr[1]))
        rows.append((round_number, f"{thr[1]:,.0f}", f"{thr[2]:,.0f}", f"{efficiencies[-1]:.2f}"))
    print(f"\ntrain.py --arch cnn --backend {backend} {' '.join(map(str, run_flags))}, batch 64 per process"
          f"{', 1 thread per process' if env else ''}; 1 process, then 2, per round")
    print_table(["round", "1 process: samples/s", "2 processes: samples/s (all)",
                 "efficiency"], rows)
    return efficiencies


def print_harness(root, quick):
    """The interleaved harness; returns the median efficiency of train.py's DDP step."""
    results = run_harness(root, quick)
    blocks = results["variants"]  # per variant, one {"phases": {phase: ms}, "step": ms} per round
    step_ms = {v.name: [block["step"] for block in blocks[v.name]] for v in VARIANTS}
    alone_ms = step_ms[ALONE.name]

    def efficiencies(v):  # per round: thr(v) / (2 thr(alone)), both from the same round
        return [v.batch_size * v.processes * alone / (2 * ALONE.batch_size * ms)
                for alone, ms in zip(alone_ms, step_ms[v.name])]

    rows = []
    for v in VARIANTS:
        median_ms = {p: statistics.median(b["phases"][p] for b in blocks[v.name]) for p in PHASES}
        step = statistics.median(step_ms[v.name])
        rows.append((v.name, f"{v.processes} x {v.threads}", v.batch_size,
                     *(f"{median_ms[p]:.2f}" for p in PHASES), f"{step:.2f}",
                     f"{v.batch_size * v.processes * 1000 / step:,.0f}",
                     "-" if v is ALONE else spread(efficiencies(v))))
    print(f"\nwhere the time goes: median ms per step over {len(alone_ms)} rounds, each variant "
          "a block of steps in turn (harness on train.py's functions, gloo); the phases are "
          "rank 0's, the step is the block's wall time until both ranks are done; efficiency "
          "against 2x the first row of the same round: median (middle half)")
    print_table(["variant", "procs x threads", "batch", *PHASES, "step", "samples/s (all)",
                 "efficiency"], rows)

    def added_ms(v):  # per round: what v's step costs beyond the same step never communicating
        return statistics.median(ms - kept for ms, kept in zip(step_ms[v.name],
                                                               step_ms[NO_ALL_REDUCE.name]))

    reduce = results["all_reduce"]
    print(f"all-reduce of the cnn's {reduce['elements']:,} fp32 gradients (gloo, 2 processes), "
          f"ms added to a step: {added_ms(TRAIN_PY_DDP):.2f} by train.py's DDP, "
          f"{added_ms(ONE_ALL_REDUCE):.2f} by one all-reduce after backward without DDP, "
          f"{added_ms(BARRIER):.2f} by a mere barrier there (the ranks waiting for each "
          f"other); {reduce['ms']:.2f} ms a call in a loop of nothing but all-reduces")
    ddp = statistics.median(efficiencies(TRAIN_PY_DDP))
    ceiling = statistics.median(efficiencies(NO_ALL_REDUCE))
    print(f"the ceiling, 2 processes that never communicate: {ceiling:.2f}; train.py's DDP "
          f"reaches {ddp / ceiling:.2f} of it")
    return ddp


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: a few steps (figures not comparable)")
    p.add_argument("--worker", metavar="DATA", help=argparse.SUPPRESS)  # set by run_harness
    args = p.parse_args()
    if args.worker:
        harness(args.worker, args.quick)
        # As train.py ends: skip the C++ teardown, where gloo aborts now and then.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    unwind_on_sigterm()  # (the parent only: torchrun stops the workers)
    print_machine()
    rounds, steps = (1, 10) if args.quick else (3, 200)
    with mnist_files(QUICK_TRAIN_SAMPLES if args.quick else MNIST_TRAIN_SAMPLES) as root:
        train_py = print_train_py(root, rounds, ["--max-steps", steps], "gloo", ONE_THREAD)
        interleaved = print_harness(root, args.quick)
        if torch.cuda.device_count() >= 2:
            # 200 steps can take less time than CUDA's start-up: time epoch 2 (the last
            # --epochs wins, and the last --metrics row is read).
            nccl = print_train_py(root, rounds, ["--epochs", 2], "nccl", None)
            print(f"nccl: efficiency {median_and_range(nccl)}")
        else:
            print(f"nccl: not run: 2 processes need 2 GPUs, torch sees {torch.cuda.device_count()}")
    print(f"train.py run by run, gloo: efficiency {median_and_range(train_py)} over {rounds} "
          "rounds (median, min to max): separate runs, so the machine's drift is in it")
    print(f"efficiency thr(2) / (2 thr(1)) of train.py's DDP step, interleaved, gloo: "
          f"{interleaved:.2f} (target >= {TARGET}): {verdict(interleaved, TARGET)}")


if __name__ == "__main__":
    main()
