"""Stand-in for train.py in launch tests: joins gloo, all-reduces, reports.

Every rank prints its rank, the world size, the sum of all ranks, a few
environment variables and its --echo argument. Each line goes out in one write:
torchrun runs workers with `python -u`, where print() writes a line in pieces that
the ranks sharing a node's stdout would interleave. A value longer than 256 characters
is printed as its SHA-256, so that the line stays within what a pipe takes in one
piece (4 KiB): a longer write may be split too.
"""

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist


def shown(value):
    if value is None or len(value) <= 256:
        return value
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()


parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1)
parser.add_argument("--sleep", type=float, default=0.0)
parser.add_argument("--echo", default="")
args = parser.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
sys.stdout.write(f"probe: running rank={rank}\n")
for _ in range(args.steps):
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    time.sleep(args.sleep)
names = ("PROBE_SECRET", "TORCH_PROBE_SECRET", "LAUNCHER_ONLY", "GLOO_SOCKET_IFNAME")
sys.stdout.write(f"probe: rank={rank} world_size={world} sum={int(total.item())} "
                 + " ".join(f"{n}={shown(os.environ.get(n))}" for n in names)
                 + f" echo={args.echo!r}\n")
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as train.py does: skip the C++ teardown that sometimes aborts with gloo
