"""Train an MNIST classifier with DistributedDataParallel, on one process or many.

    python train.py --arch cnn --dataset synthetic --epochs 2          # one process
    torchrun --standalone --nproc_per_node=2 train.py --arch cnn       # one machine
    ./launch.sh hosts.txt 4                                            # many machines

The same code path serves all three: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE,
and without them this is a world of one. It is the usual torchrun + DDP tutorial
pattern with its bugs fixed; each fix is marked "Fix:" where it happens.

The whole data set lives on the device as one uint8 tensor and is batched by
indexing, so there is no DataLoader and no worker process. A run whose
--checkpoint-dir holds last.pt resumes from it, and the resumed run ends bitwise
equal to one that was never stopped (CPU, gloo, the same world size, batch size and
OMP_NUM_THREADS). It may also resume on another number of processes that keeps the global
batch: the same batches in the same order (each epoch's last aside), but not bitwise.

To train your own data and model, add a branch to build_data and to build_model, and its
name to --dataset and --arch. A build_data branch gives uint8 images as (N, C, H, W) and
int64 labels, on the CPU; the model takes those images and gives NUM_CLASSES outputs.
normalize() makes a batch floats with MNIST's mean and std: set your data's. A checkpoint
knows the data by its bytes, not by what normalize does to them: a resumed run with another
normalize goes on without a word. build_optimizer makes the optimizer; the loss is in
train_one_epoch and evaluate.
"""
import argparse
import contextlib
import ctypes
import datetime
import functools
import glob
import importlib.util
import ipaddress
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import zlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

MNIST_MEAN, MNIST_STD = 0.1307, 0.3081  # Fix: the pattern normalised with (0.5, 0.5).
NUM_CLASSES = 10  # MNIST's digits: the models' outputs, and the labels' range
MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
EVAL_BATCH_SIZE = 1024
DOWNLOAD_STALL_SECONDS = 60  # a download that receives nothing for this long fails
ARCH_NAME = re.compile(r"(sm|compute)_(\d+)([af]?)")  # in torch.cuda.get_arch_list()
# Arguments a resumed run may change: how long it runs, where it reads and writes, what it
# prints, and how processes meet. All others (any you add, too) fix the training trajectory:
# a checkpoint resumes only a run that agrees on them. The batch size and accumulation may
# change too, as long as the global batch does not (see why_not_resumable).
RESUME_MAY_CHANGE_ARGS = ["data", "no_download", "epochs", "max_steps", "backend", "timeout",
                          "checkpoint_dir", "save_every", "log_every", "metrics",
                          "batch_size", "accum_steps"]
# Arguments that may differ from node to node (a path on each node's own disks); all the
# others must be rank 0's on every rank.
PER_NODE_ARGS = ["data"]
# Keys that every checkpoint of this train.py has; a file without all of them was not written
# by it. (Two later keys are read with .get, so that an older file gets a message, not a
# KeyError: one without "optimizer_defaults" resumes, one without "data" is refused.)
CHECKPOINT_KEYS = {"model", "optimizer", "scaler", "epoch", "step", "rng", "args", "world_size"}
# What gloo's collectives raise on a rank whose peer is gone (it failed, or was stopped) or
# stayed away past --timeout: plain RuntimeErrors, known by their text.
LOST_PEER_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                   "Timed out waiting")


class UsageError(Exception):
    """A problem the user can fix; main() prints it as one line instead of a traceback."""


def let_local_rank_0_speak():
    """Call before printing an error that, before the process group exists, every rank of
    the node has alike. Under torchrun (LOCAL_WORLD_SIZE set) local rank 0 says it once: the
    others wait, and torchrun stops them once it has exited. Without torchrun, each rank
    says its own."""
    if int(os.environ.get("LOCAL_RANK", 0)) != 0 and "LOCAL_WORLD_SIZE" in os.environ:
        time.sleep(10)


# ----------------------------------------------------------------------------- arguments

def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def nonempty(text):
    """A path that must not be "": `--checkpoint-dir "$CKPT"` with CKPT unset would otherwise
    turn checkpoints off without a word."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def positive_float(text):
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def seed_number(text):
    value = int(text)
    if not 0 <= value < 2**32:  # as numpy takes them; torch's take 64 bits, and the rank is added
        raise argparse.ArgumentTypeError(f"must be 0 to 2**32 - 1, got {text}")
    return value


def timeout_seconds(text):
    value = positive_int(text)
    if value > 86400:  # a datetime.timedelta overflows past 10**14 s; a day is ample
        raise argparse.ArgumentTypeError(f"must be at most 86400 (a day), got {text}")
    return value


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        let_local_rank_0_speak()
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def parse_args(argv=None):
    p = OneLineErrorParser(description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--dataset", choices=["mnist", "synthetic"], default="mnist",
                   help="mnist: MNIST's four idx files in --data/MNIST/raw, fetched by torchvision "
                        "if missing; synthetic: a generated, learnable set of the same shape "
                        "that needs no download")
    p.add_argument("--data", type=nonempty, default="./data",
                   help="directory that holds (or receives) MNIST")
    p.add_argument("--no-download", action="store_true",
                   help="never download MNIST; fail with a message if the files are missing")
    p.add_argument("--arch", choices=["resnet18", "cnn"], default="resnet18",
                   help="resnet18: torchvision's, 1-channel stem; cnn: small and fast, for CPUs")
    # Fix: the pattern looped over an undefined `epochs`.
    p.add_argument("--epochs", type=positive_int, default=2,
                   help="total epochs of the run, counted from its start, not from a resume")
    p.add_argument("--max-steps", type=positive_int, default=None,
                   help="stop (evaluate, save) after this many optimizer steps in total, "
                        "or at the end of --epochs if that comes first")
    p.add_argument("--batch-size", type=positive_int, default=64,
                   help="samples per process per micro-step; the global batch is "
                        "batch-size x world size x accum-steps")
    p.add_argument("--accum-steps", type=positive_int, default=1,
                   help="micro-steps per optimizer step (gradient accumulation)")
    p.add_argument("--lr", type=positive_float, default=0.01, help="SGD learning rate")
    p.add_argument("--seed", type=seed_number, default=0, help="seed of weights and data order")
    p.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none",
                   help="mixed precision; fp16 uses a gradient scaler, bf16 needs none")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="process group backend; auto is nccl on CUDA, gloo on CPU "
                        "(gloo trains on the CPU even where there are GPUs)")
    p.add_argument("--timeout", type=timeout_seconds, default=300,
                   help="seconds a collective may wait for a peer before the job fails")
    p.add_argument("--checkpoint-dir", type=nonempty, default=None,
                   help="save DIR/last.pt there, and resume from it when it exists")
    p.add_argument("--save-every", type=positive_int, default=None,
                   help="also save every N optimizer steps")
    p.add_argument("--log-every", type=positive_int, default=None,
                   help="print a progress line every N optimizer steps, not only per epoch")
    p.add_argument("--metrics", type=nonempty, default=None,
                   help="append one JSON line per epoch to this file")
    args = p.parse_args(argv)
    if args.save_every and not args.checkpoint_dir:
        p.error("--save-every needs --checkpoint-dir")
    if args.arch == "resnet18" and importlib.util.find_spec("torchvision") is None:
        p.error("--arch resnet18 needs torchvision: pip install torchvision, or use --arch cnn")
    return args


# ----------------------------------------------------------------------------- distributed

def setup_distributed(args):
    """Return (rank, local_rank, world_size, device); init the process group under torchrun."""
    end_with_torchrun()
    # Fix: the pattern used LOCAL_RANK as the global rank, so each node's first process
    # logged and saved. RANK says who is global rank 0; LOCAL_RANK only picks the device.
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if "RANK" not in os.environ and world_size != 1:  # else it would train on 1/world_size alone
        raise UsageError(f"WORLD_SIZE is {world_size} but RANK is not set: start train.py with "
                         "torchrun, which sets them all, or unset WORLD_SIZE")
    backend = args.backend
    if backend == "auto":
        why_no_gpu = gpus_torch_cannot_see()
        if why_no_gpu:  # else it would train on the CPU, or hang beside nodes that run nccl
            raise UsageError(f"{socket.gethostname()} has {why_no_gpu}; pass --backend gloo to "
                             "train on the CPU")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        device = gpu_of_this_process(local_rank)
    else:
        # Fix: .cuda(rank) crashed on machines without a GPU; gloo runs on the CPU.
        device = torch.device("cpu")
    if "RANK" in os.environ:  # started by torchrun (or launch.sh, which runs torchrun)
        check_torchrun_env(backend, world_size)
        # A bounded timeout: a dead peer ends the job instead of hanging it. device_id binds
        # NCCL to this process's GPU instead of letting it guess one from the global rank.
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                                device_id=device if backend == "nccl" else None)
    return rank, local_rank, world_size, device


def end_with_torchrun():
    """Under torchrun, on Linux: when torchrun ends, the kernel sends this process SIGTERM, as
    torchrun does when it stops a job. torchrun starts each worker in a session of its own, so
    a kill -9 of torchrun reaches none of them: they would train on, unseen, writing
    checkpoints beside the run started in its place. (A worker whose torchrun dies before
    this call, while it imports torch, waits minutes for the rendezvous, then fails.)"""
    if sys.platform == "linux" and "TORCHELASTIC_RUN_ID" in os.environ:
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def gpu_of_this_process(local_rank):
    """The GPU that LOCAL_RANK picks, once checked that it exists and that torch has kernels
    for it, made the current device."""
    if not torch.cuda.is_available():
        raise UsageError("--backend nccl needs CUDA, and torch sees no GPU here")
    gpus = torch.cuda.device_count()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if local_world_size > gpus:
        raise UsageError(f"{local_world_size} processes on {socket.gethostname()}, which has "
                         f"{gpus} GPU(s) visible: run at most that many processes per node")
    if not 0 <= local_rank < gpus:  # LOCAL_RANK set without torchrun's LOCAL_WORLD_SIZE
        raise UsageError(f"LOCAL_RANK {local_rank}, but {socket.gethostname()} has {gpus} "
                         f"GPU(s) visible: LOCAL_RANK picks the GPU, 0 to {gpus - 1}")
    device = torch.device("cuda", local_rank)
    major, minor = torch.cuda.get_device_capability(device)
    built_for = torch_built_for((major, minor))
    if built_for:  # else every rank dies at its first kernel, "no kernel image is available"
        raise UsageError(f"{socket.gethostname()}'s {torch.cuda.get_device_name(device)} "
                         f"(compute capability {major}.{minor}) has no kernels in torch "
                         f"{torch.__version__}, built for {built_for}: install a torch "
                         f"build with kernels for sm_{major}{minor}")
    # Fix: the pattern never called set_device, so NCCL put every process's
    # buffers on GPU 0. It must come before init_process_group.
    torch.cuda.set_device(device)
    return device


def check_torchrun_env(backend, world_size):
    """What torchrun sets, and what a job across hosts or with restarts needs of it."""
    missing = [v for v in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if v not in os.environ]
    if missing:
        raise UsageError(f"RANK is set but not {', '.join(missing)}: start train.py with "
                         "torchrun, which sets them all, or unset RANK")
    hosts_beside_this = int(os.environ.get("LOCAL_WORLD_SIZE", world_size)) < world_size
    if backend == "gloo" and hosts_beside_this:
        check_other_hosts_can_reach_gloo()
    # By default torchrun's restarts reuse the rendezvous store of the first round, and
    # restarted workers can read the addresses of dead ones: they fail to connect or hang
    # (pytorch#135712, #167288).
    if (int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0
            and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"):
        raise UsageError("torchrun --max-restarts restarts reliably only with a fresh store "
                         "per round: set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun and "
                         "use --standalone or --rdzv-backend=c10d (launch.sh does both)")


def distributed():
    return dist.is_available() and dist.is_initialized()


def all_reduce_sum(tensor):
    if distributed():
        dist.all_reduce(tensor)
    return tensor


def broadcast_from_rank0(obj):
    if not distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def broadcast_buffers_from_rank0(model):
    if distributed():
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def all_gather(obj):
    """Every rank's obj as a list, in rank order, on every rank."""
    if not distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def describe(e):
    """An exception as one line. torch.load wraps what it found wrong in a file in
    paragraphs that suggest weights_only=False, which would run code from the file."""
    if isinstance(e, pickle.UnpicklingError) and e.__context__ is not None:
        e = e.__context__
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def print_errors(errors):
    sys.stderr.write("".join(f"train.py: error: {e}\n" for e in errors))
    sys.stderr.flush()


def stop_together(error, secondary=False):
    """Stop every rank if any rank has an error message, so that no rank is left waiting
    for the others at the next collective. Rank 0 prints each distinct message once; a
    secondary one (likely a consequence of another rank's) only if no rank has another."""
    gathered = [(e, s) for e, s in all_gather((error, secondary)) if e is not None]
    if not gathered:
        return
    errors = [e for e, s in gathered if not s] or [e for e, _ in gathered]
    if not distributed() or dist.get_rank() == 0:
        print_errors(list(dict.fromkeys(errors)))
    if distributed():
        dist.barrier()  # torchrun stops every rank when one exits: not before rank 0 has said why
    raise SystemExit(1)


# ----------------------------------------------------------------------------- data

def synthetic_mnist(num_samples, seed):
    """uint8 images of MNIST's shape: each class is a fixed random pattern of pixels, drawn
    at a random brightness under strong noise, so accuracy climbs well above chance."""
    patterns = (torch.rand(10, 28, 28, generator=torch.Generator().manual_seed(0)) > 0.85)
    patterns = patterns.to(torch.uint8)  # the same for every split; only the samples differ
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (num_samples,), generator=g)
    brightness = torch.randint(64, 128, (num_samples, 1, 1), generator=g, dtype=torch.uint8)
    noise = torch.randint(0, 128, (num_samples, 28, 28), generator=g, dtype=torch.uint8)
    return noise + patterns[labels] * brightness, labels  # at most 127 + 127: no overflow


def read_idx(path):
    """A uint8 tensor from one of MNIST's idx files: two zero bytes, 0x08 (uint8), the number
    of dimensions, each dimension as a big-endian int32, then the values."""
    with open(path, "rb") as f:
        data = f.read()
    zero, value_type, ndim = struct.unpack_from(">HBB", data)
    if zero != 0 or value_type != 0x08:
        raise ValueError(f"{path} is not an idx file of uint8")
    shape = struct.unpack_from(f">{ndim}I", data, 4)
    values = math.prod(shape)
    if values == 0:
        raise ValueError(f"{path} holds no samples")
    header = 4 + 4 * ndim
    if len(data) != header + values:
        raise ValueError(f"{path} holds {len(data) - header} bytes of values, not {values}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=header).view(shape)


def run_while_the_others_wait(work, device):
    """Run work() here, unless it is None, while every rank checks in each second until
    no rank's work is left: a wait of any length (a download, a large checkpoint on a slow
    disk) is then many short collectives, none of which reaches --timeout. Return (what
    work returned, the exception it raised), None for either that did not happen."""
    outcome = [None, None]

    def run():
        try:
            outcome[0] = work()
        except Exception as e:  # offline, a mirror down, a full disk, a corrupt file ...
            outcome[1] = e

    thread = None
    if work is not None:
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
    while True:
        busy = 0
        if thread is not None:
            thread.join(timeout=1)
            busy = int(thread.is_alive())
        if all_reduce_sum(torch.tensor([busy], device=device)).item() == 0:
            return tuple(outcome)


def download_mnist(root):
    """torchvision writes each file in place, a piece at a time: it downloads into a directory
    of this process's own, and each file then moves into place whole. Nodes that share root
    may download at once, and a reader sees no half-written file (nor, after a crash, the next
    run). The .gz files already in MNIST/raw (downloaded by hand) are used, as torchvision
    would. A process killed mid-download leaves that directory, MNIST/raw/.download-*."""
    import torchvision  # only to download: reading needs no torchvision
    raw = os.path.join(root, "MNIST", "raw")
    os.makedirs(raw, exist_ok=True)
    own = tempfile.mkdtemp(prefix=".download-", dir=raw)  # on raw's filesystem, for os.replace
    own_raw = os.path.join(own, "MNIST", "raw")
    default_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(DOWNLOAD_STALL_SECONDS)  # else a stalled download hangs the job
    try:
        os.makedirs(own_raw)
        for archive in glob.glob(os.path.join(raw, "*.gz")):
            shutil.copy(archive, own_raw)
        for split_is_train in (True, False):
            torchvision.datasets.MNIST(own, train=split_is_train, download=True)
        for name in MNIST_FILES:
            os.replace(os.path.join(own_raw, name), os.path.join(raw, name))
    finally:
        socket.setdefaulttimeout(default_timeout)
        shutil.rmtree(own, ignore_errors=True)


def load_mnist(root, download, rank, local_rank, device):
    """MNIST as uint8 tensors; rank 0 downloads while the others wait."""
    raw = os.path.join(root, "MNIST", "raw")  # torchvision's layout

    def present():
        return all(os.path.exists(os.path.join(raw, f)) for f in MNIST_FILES)

    error = None
    # Fix: every rank downloaded at once and raced on the same files. Global rank 0
    # downloads first; then, for nodes that share no filesystem with it, each node's
    # local rank 0. Everyone else waits, for as long as a slow network takes.
    for is_downloader in (rank == 0, local_rank == 0):
        needed = is_downloader and download and not present() and error is None
        fetch = functools.partial(download_mnist, root) if needed else None
        _, failure = run_while_the_others_wait(fetch, device)
        if failure is not None:
            error = f"download failed ({describe(failure)})"
    if not present() and error is None:
        error = "the files are missing and --no-download is set" if not download else "not found"
    if error is None:
        try:
            paths = [os.path.join(raw, f) for f in MNIST_FILES]
            train_x, train_y, test_x, test_y = (read_idx(path) for path in paths)
            for images, labels, labels_path in ((train_x, train_y, paths[1]),
                                                (test_x, test_y, paths[3])):
                if images.shape[1:] != (28, 28) or labels.shape != images.shape[:1]:
                    raise ValueError(f"images {tuple(images.shape)} and labels "
                                     f"{tuple(labels.shape)} are not (N, 28, 28) and (N,)")
                top_label = int(labels.max())
                if top_label >= NUM_CLASSES:  # else cross_entropy fails, maybe epochs later
                    raise ValueError(f"{labels_path} has a label {top_label}; MNIST's are 0 to 9")
        except (OSError, ValueError, struct.error) as e:
            error = f"cannot read them ({describe(e)})"
    # "not found" on a rank that did not download follows from its node's failed download,
    # which that node's local rank 0 explains.
    secondary = error == "not found" and local_rank != 0
    if error is not None:  # the ranks of a node that fail alike send one message, printed once
        error = (f"MNIST unavailable on {socket.gethostname()}: {error}. Put "
                 f"{', '.join(MNIST_FILES)} in {os.path.abspath(raw)}, or use --dataset synthetic")
    stop_together(error, secondary)
    return train_x.unsqueeze(1), train_y.long(), test_x.unsqueeze(1), test_y.long()  # 1 channel


def build_data(args, rank, local_rank, device):
    """(train_x, train_y, test_x, test_y) on the device. Each branch gives images as uint8
    (N, C, H, W), the shape the model takes, so that normalize changes values only, and
    labels as int64 (N,), on the CPU."""
    if args.dataset == "synthetic":
        # The same fixed seed on every rank, so all ranks hold the same data set.
        train_x, train_y = synthetic_mnist(60_000, seed=1)
        test_x, test_y = synthetic_mnist(10_000, seed=2)
        train_x, test_x = train_x.unsqueeze(1), test_x.unsqueeze(1)  # 1 channel
    else:
        train_x, train_y, test_x, test_y = load_mnist(args.data, not args.no_download,
                                                       rank, local_rank, device)
    # Fix: the pattern pushed a 47 MB data set through a per-sample PIL DataLoader with 8
    # workers per rank. One tensor on the device, indexed per batch, is many times faster.
    return tuple(t.to(device) for t in (train_x, train_y, test_x, test_y))


def check_data_layout(tensors):
    """Stop unless build_data gave what normalize and the model take: uint8 images (N, C, H, W)
    and int64 labels (N,) below NUM_CLASSES. Float images in [0, 1], as ToTensor makes them,
    would be divided by 255 again and train at chance, without an error."""
    error = None
    for split, images, labels in (("training", *tensors[:2]), ("test", *tensors[2:])):
        if (images.dtype != torch.uint8 or images.dim() != 4 or labels.dtype != torch.int64
                or labels.shape != images.shape[:1]):
            error = (f"build_data gave {split} images {images.dtype} {tuple(images.shape)} and "
                     f"labels {labels.dtype} {tuple(labels.shape)}; normalize and the model take "
                     "uint8 images (N, C, H, W) and int64 labels (N,)")
        elif len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) < NUM_CLASSES:
            error = (f"build_data gave {split} labels from {int(labels.min())} to "
                     f"{int(labels.max())}; the model has NUM_CLASSES = {NUM_CLASSES} outputs")
    stop_together(error)


def check_same_args_everywhere(args):
    """Stop unless every rank has rank 0's arguments. Started by hand on each node, torchrun
    takes each node's own command line, and a node whose line differs would train on other
    samples, at another rate, or hang the job at a collective its ranks skip."""
    mine = {k: v for k, v in vars(args).items() if k not in PER_NODE_ARGS}
    host0, theirs = all_gather((socket.gethostname(), mine))[0]
    differing = [f"--{k.replace('_', '-')} {mine[k]} (rank 0: {theirs[k]})"
                 for k in mine if mine[k] != theirs[k]]
    error = None
    if differing:
        error = (f"train.py on {socket.gethostname()} has other arguments than rank 0 on {host0}: "
                 f"{', '.join(differing)}; start every node with the same ones")
    stop_together(error)


def check_same_data_everywhere(tensors):
    """Stop unless every rank holds rank 0's data set, and return what identifies it. Nodes
    with different copies of MNIST would train on different samples, and with different
    sizes take different numbers of steps and hang at the first collective one skips."""
    crc = 0
    for t in tensors:
        # As bytes, whatever the dtype (numpy has no bfloat16); 8 ms for MNIST.
        crc = zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy(), crc)
    mine = f"{len(tensors[0])} training and {len(tensors[2])} test samples, CRC32 {crc:08x}"
    host0, theirs = all_gather((socket.gethostname(), mine))[0]
    error = None
    if mine != theirs:
        error = (f"the data set on {socket.gethostname()} ({mine}) differs from rank 0's on "
                 f"{host0} ({theirs}): give every node the same files (data made in code needs "
                 "the same seed on every rank)")
    stop_together(error)
    return mine


def normalize(images):
    """uint8 pixels -> floats with MNIST's mean and std (for data of your own, its own)."""
    return (images.float() / 255 - MNIST_MEAN) / MNIST_STD


def epoch_order(num_samples, epoch, rank, world_size, seed):
    """This rank's sample indices for one epoch: DistributedSampler's shards exactly."""
    sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=seed)
    # Fix: without set_epoch every epoch repeats the same order.
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler))


# ----------------------------------------------------------------------------- model

class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 7 * 7, NUM_CLASSES)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def check_no_batch_of_one(model, samples_per_rank, batch_size):
    """BatchNorm cannot train on a micro-batch of one sample (resnet18's last one sees a
    1x1 map); refuse a --batch-size that makes one, before any training is lost."""
    has_batch_norm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    error = None
    if has_batch_norm and samples_per_rank == 1:
        error = ("each rank gets one sample per epoch, on which the model's BatchNorm cannot "
                 "train: use fewer processes, more data, or --arch cnn")
    elif has_batch_norm and (batch_size == 1 or samples_per_rank % batch_size == 1):
        error = (f"--batch-size {batch_size} leaves micro-batches of one sample "
                 f"({samples_per_rank} samples per rank), on which the model's "
                 "BatchNorm cannot train: choose another --batch-size")
    stop_together(error)


def build_model(arch):
    """A model for MNIST's 1-channel 28x28 images; one for other images goes in a branch."""
    if arch == "cnn":
        return SmallCNN()
    import torchvision
    # Fix: resnet18(pretrained=False) is deprecated and has a 3-channel stem, which
    # crashed on MNIST's 1-channel images. weights=None, a 1-channel stem, 10 classes.
    model = torchvision.models.resnet18(weights=None, num_classes=NUM_CLASSES)
    model.conv1 = nn.Conv2d(1, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


def build_optimizer(model, args):
    # An LR scheduler, if you add one, goes into the checkpoint too, or resume is not exact.
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def wrap_ddp(model, device):
    if not distributed():
        return model
    # A model of yours with parameters that get no gradient in some steps needs
    # find_unused_parameters=True here, or DDP raises an error at the step after one.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              gradient_as_bucket_view=True)
    if dist.get_backend() == "gloo":
        # For bitwise resume: DDP re-buckets gradients after a process's first step, so a
        # resumed process would all-reduce that step in the old layout, which gloo's ring
        # sums in another order (from 3 ranks up). Fix the final layout now (private API).
        # Its buckets follow the parameters' order, not backward's, so all-reduce waits for
        # the whole backward instead of overlapping it: no cost measured on a CPU (resnet18,
        # 2 ranks, 2 cores). nccl keeps DDP's layout: its runs are not bitwise repeatable
        # anyway, as it picks its algorithm by size and topology.
        ddp.reducer._push_all_rebuilt_params()
        ddp.reducer._rebuild_buckets()
    return ddp


# ----------------------------------------------------------------------------- checkpoints

def rng_state(device):
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_state(state, device):
    """`state` from rng_state() on the same kind of device."""
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def seed_rank_stream(seed, rank, step):
    """Seed dropout masks and the like from `step` on: a stream per rank, so that ranks draw
    independently (DDP gives every rank rank 0's initial weights), and per step, so that a
    resume that cannot restore the saved streams does not repeat the first steps' masks.
    From 2**32 up, apart from --seed's stream, with which every rank builds the data and model."""
    torch.manual_seed(seed + rank + ((step + 1) << 32))


def checkpoint_path(args):
    return os.path.join(args.checkpoint_dir, "last.pt") if args.checkpoint_dir else None


def prepare_outputs(args, ckpt_path, rank):
    """Rank 0 creates the checkpoint directory and the metrics file now, so that a path it
    cannot write stops the run at start-up instead of after the first epoch."""
    error = None
    if rank == 0:
        try:
            if args.checkpoint_dir:
                os.makedirs(args.checkpoint_dir, exist_ok=True)
                # It may exist and still be read-only: write what save_checkpoint writes first.
                probe = f"{ckpt_path}.tmp"
                open(probe, "ab").close()
                os.remove(probe)
            if args.metrics:
                open(args.metrics, "a").close()
        except FileExistsError:  # from makedirs
            error = f"--checkpoint-dir {args.checkpoint_dir} exists and is not a directory"
        except OSError as e:
            error = f"cannot write {e.filename}: {e.strerror}"
    stop_together(error)


def plain_args(args):
    """The arguments as torch.load(weights_only=True) reads them back: a type it does not
    know (an argument of type=pathlib.Path, say) would make every checkpoint unloadable."""
    return json.loads(json.dumps(vars(args), default=str))


def save_checkpoint(path, model, optimizer, scaler, epoch, step, args, data_id, device,
                    rank):
    """Global rank 0 writes `path` atomically. Every rank must call this: RNG states are
    gathered from all, and a save that fails stops them all."""
    # Fix: the pattern saved nothing, so a crash lost the whole run.
    rng_states = all_gather(rng_state(device))
    write = None
    if rank == 0:
        state = {
            "model": model.state_dict(),  # unwrapped: no "module." or "_orig_mod." prefixes
            "optimizer": optimizer.state_dict(),
            "optimizer_defaults": optimizer.defaults,  # the code's settings, for why_not_resumable
            "scaler": scaler.state_dict(),
            "epoch": epoch,  # the epoch in progress (for people; resume goes by step)
            "step": step,  # optimizer steps done in total
            "rng": rng_states,  # one per rank, so dropout and the like also resume exactly
            "args": plain_args(args),
            "world_size": len(rng_states),
            "data": data_id,  # --data may move; what it holds may not change
        }
        tmp = f"{path}.tmp"
        write = functools.partial(write_atomically, state, path, tmp)
    _, failure = run_while_the_others_wait(write, device)
    error = None
    if failure is not None:
        # A full disk, say. torch.save reports a failed write as a RuntimeError
        # ("unexpected pos ...") whose context is the OSError.
        cause = failure if isinstance(failure, OSError) else failure.__context__
        if not isinstance(cause, OSError):
            raise failure
        # Stop now: training on without checkpoints would risk every step from here.
        error = (f"cannot write {cause.filename or tmp}: {cause.strerror}; "
                 f"{path} holds the last checkpoint saved, if any")
    stop_together(error)


def write_atomically(state, path, tmp):
    """torch.save `state` to `tmp`, then rename it to `path`: a crash at any moment leaves
    the previous `path` intact. A failed write leaves no `tmp` taking the disk; a process
    killed in mid-write does, until prepare_outputs removes it at the next start."""
    directory = os.path.dirname(path) or "."
    try:
        os.makedirs(directory, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    # The rename too must reach the disk, or a power cut may undo it. Best effort: a directory
    # may refuse to be opened (no read permission) or fsynced, and the file is saved anyway.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def checkpoint_step(path):
    """The step of the checkpoint at `path`, or None if it is missing or unreadable. mmap
    leaves the tensors on disk: this reads little more than the file's index."""
    try:
        step = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]
    except Exception:
        return None
    return step if isinstance(step, int) else None


def load_checkpoint(path, args, data_id, optimizer, device, rank, world_size):
    """Rank 0 reads `path` (None if absent) and every rank gets a copy: nodes without a
    shared filesystem have no last.pt of their own and must still resume with rank 0."""
    # Without a shared filesystem, only the node of the last run's rank 0 holds last.pt, or
    # the newest one. torchrun orders nodes by address, so a node added or replaced can take
    # rank 0: it must neither start over nor go back to an older copy of its own.
    found = all_gather((socket.gethostname(), os.path.exists(path), checkpoint_step(path)))
    host0, exists0, step0 = found[0]
    ahead = sorted({f"{host} (step {step})" for host, _, step in found
                    if step is not None and step0 is not None and step > step0})
    checkpoint, error = None, None
    if rank == 0 and not exists0 and any(exists for _, exists, _ in found):
        holders = sorted({host for host, exists, _ in found if exists})
        error = (f"checkpoint {path} is on {', '.join(holders)} but not on {host0}, "
                 "where global rank 0 runs, and resumes from it: copy it there, or put "
                 "--checkpoint-dir on a filesystem that every node shares")
    elif rank == 0 and ahead:
        error = (f"checkpoint {path} on {', '.join(ahead)} is newer than on {host0} (step "
                 f"{step0}), where global rank 0 runs, and resumes from its own: copy the "
                 "newest there, or put --checkpoint-dir on a filesystem that every node shares")
    read = None
    if rank == 0 and exists0 and error is None:  # weights_only: it loads no code
        read = functools.partial(torch.load, path, map_location="cpu", weights_only=True)
    checkpoint, failure = run_while_the_others_wait(read, device)
    if read is not None and failure is None:
        try:
            problem = why_not_resumable(checkpoint, args, data_id, optimizer, world_size)
        except Exception as e:  # a file of other keys or types
            failure = e
        else:
            error = f"checkpoint {path} {problem}" if problem else None
    if failure is not None:  # truncated, corrupt, malformed: never start over silently
        error = (f"checkpoint {path} is unreadable ({describe(failure)}); "
                 "move it away to start over, or restore a good copy")
    stop_together(error)
    return broadcast_from_rank0(checkpoint)


def why_not_resumable(checkpoint, args, data_id, optimizer, world_size):
    """Why this run cannot go on from `checkpoint`, or None. It may split the global batch
    into another world size, batch size and accumulation: each rank's shard is every
    world_size-th sample of one shuffled order (DistributedSampler's, padded to a multiple of
    world_size), so whatever the split, step k takes the same k-th slice of that order, and
    an epoch has as many steps. Only an epoch's last step may differ, where the world sizes
    pad the order differently."""
    keys = checkpoint.keys() if isinstance(checkpoint, dict) else set()
    missing = sorted(CHECKPOINT_KEYS - keys)
    if missing:
        return (f"holds no {', '.join(missing)}, so this train.py did not write it; "
                "move it away to start over, or use another --checkpoint-dir")
    mine = plain_args(args)
    theirs = {k: checkpoint["args"].get(k, "(absent)") for k in mine}  # (absent): added since
    mismatched = [f"--{k.replace('_', '-')} {theirs[k]} (now {mine[k]})"
                  for k in mine if k not in RESUME_MAY_CHANGE_ARGS and theirs[k] != mine[k]]
    their_data = checkpoint.get("data", "(absent)")  # (absent): written before train.py kept it
    if their_data != data_id:
        mismatched.append(f"data {their_data} (now {data_id})")
    mismatched += changed_optimizer_settings(checkpoint, optimizer)
    if mismatched:
        return (f"was written by a run with {', '.join(mismatched)}; exact resume needs the "
                "same settings: use them, or another --checkpoint-dir")
    their_split = batch_split(checkpoint["world_size"], checkpoint["args"])
    my_split = batch_split(world_size, mine)
    global_batch = math.prod(their_split)
    if math.prod(my_split) != global_batch:
        per_rank, left = divmod(global_batch, world_size)
        accum_steps = args.accum_steps if per_rank % args.accum_steps == 0 else 1
        hint = (f"a world size that divides {global_batch}" if left else
                describe_split((world_size, per_rank // accum_steps, accum_steps)) + ", say")
        return (f"was written by a run with a global batch of {global_batch} "
                f"({describe_split(their_split)}), and this one has {math.prod(my_split)} "
                f"({describe_split(my_split)}): resume needs the same global batch ({hint}), "
                "or use another --checkpoint-dir")
    return None


def changed_optimizer_settings(checkpoint, optimizer):
    """The optimizer settings in the code (momentum, weight decay ...) that differ from the
    checkpoint's, which load_state_dict would silently put back. It compares the defaults the
    code built the optimizer with, which no scheduler moves (OneCycleLR moves each param
    group's momentum); --lr is checked with the arguments. A setting only one side has (added
    by another torch, or a checkpoint from before train.py saved them) is not compared."""
    theirs = checkpoint.get("optimizer_defaults", {})
    return [f"optimizer {key} {theirs[key]} (now {value})"
            for key, value in sorted(optimizer.defaults.items())
            if key != "lr" and key in theirs and theirs[key] != value]


def batch_split(world_size, args):
    """How a run splits its global batch: (processes, --batch-size, --accum-steps)."""
    return world_size, args["batch_size"], args["accum_steps"]


def describe_split(split):
    return "world size {} x --batch-size {} x --accum-steps {}".format(*split)


def resume_from(checkpoint, path, model, optimizer, scaler, args, device, rank, world_size):
    """Load the checkpoint's state into this rank; return the step to go on from."""
    error = None
    try:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])
    except (RuntimeError, ValueError, KeyError) as e:  # the model's or optimizer's code changed
        error = (f"checkpoint {path} does not fit this model and optimizer ({describe(e)}); "
                 "move it away to start over, or use another --checkpoint-dir")
    stop_together(error)
    their_split = batch_split(checkpoint["world_size"], checkpoint["args"])
    my_split = batch_split(world_size, vars(args))
    saved_rng = checkpoint["rng"][rank] if their_split[0] == world_size else None
    other_device = (saved_rng is not None
                    and (saved_rng["cuda"] is not None) != (device.type == "cuda"))
    if saved_rng is not None and not other_device:
        set_rng_state(saved_rng, device)
    else:  # no rank of the checkpoint's is this one, or it drew on another kind of device
        seed_rank_stream(args.seed, rank, checkpoint["step"])
    if rank == 0:
        how = ""
        if other_device:
            how += ", with new random states: the checkpoint's are of another kind of device"
        if my_split != their_split:
            how += (f", as {describe_split(my_split)} instead of {describe_split(their_split)}: "
                    "the same global batches in the same order (but for the padding of each "
                    "epoch's last), " + ("with new random states, " if saved_rng is None else "")
                    + "not bitwise the same run")
        log(f"resumed from {path} at step {checkpoint['step']}{how}")
    return checkpoint["step"]


# ----------------------------------------------------------------------------- train / eval

def autocast(args, device):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def train_one_epoch(ddp_model, optimizer, scaler, train_x, train_y, order, args, device,
                    after_step):
    """One optimizer step per `accum_steps` micro-batches of `order`, this rank's sample
    indices for what is left of the epoch. after_step(n, loss_sum, samples) runs after the
    n-th step and returns the seconds it took, which the timing leaves out. Returns (mean loss
    of all ranks, samples of all ranks, seconds)."""
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    samples, paused = 0, 0.0
    start = time.perf_counter()
    for n, step_indices in enumerate(order.split(args.batch_size * args.accum_steps), start=1):
        micro_batches = step_indices.split(args.batch_size)
        for i, idx in enumerate(micro_batches):
            x, y = normalize(train_x[idx]), train_y[idx]
            # Only the last micro-batch all-reduces; the others accumulate locally.
            last = i == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last or not distributed() else ddp_model.no_sync()
            with sync:
                with autocast(args, device):
                    loss = F.cross_entropy(ddp_model(x), y)
                # Each micro-batch weighs by its share of the step: the epoch's last may be short.
                scaler.scale(loss * (len(idx) / len(step_indices))).backward()
            loss_sum += loss.detach() * len(idx)  # no .item(): the loop does not wait for the GPU
            samples += len(idx)
        # To clip gradients, clip them here, after scaler.unscale_(optimizer).
        scaler.step(optimizer)  # skips the step if fp16 gradients overflowed (which waits)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        paused += after_step(n, loss_sum, samples)
    totals = all_reduce_sum(torch.stack([loss_sum, loss_sum.new_tensor(samples)]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # CUDA runs ahead of Python: stop the clock when it is done
    seconds = time.perf_counter() - start - paused
    return (totals[0] / totals[1]).item(), int(totals[1]), seconds


@torch.no_grad()
def evaluate(model, test_x, test_y, args, device, rank, world_size):
    """Exact accuracy over the whole test set: each rank takes every world_size-th sample
    (no padding, so no sample counts twice) and the counts are summed across ranks."""
    # Fix: the pattern never evaluated, so nothing said whether training worked.
    # The unwrapped model: DDP's forward syncs buffers, a collective that would hang where
    # ranks run different numbers of eval batches. Each rank's BatchNorm statistics have
    # moved since DDP last synced them: take rank 0's, the ones it saves.
    broadcast_buffers_from_rank0(model)
    model.eval()
    mine = torch.arange(rank, len(test_x), world_size, device=device)
    totals = torch.zeros(3, device=device, dtype=torch.float64)  # loss sum, correct, count
    for i in range(0, len(mine), EVAL_BATCH_SIZE):
        idx = mine[i:i + EVAL_BATCH_SIZE]
        with autocast(args, device):
            logits = model(normalize(test_x[idx]))
        y = test_y[idx]
        totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
        totals[1] += (logits.argmax(1) == y).sum()
        totals[2] += len(idx)
    model.train()
    loss_sum, correct, count = all_reduce_sum(totals).tolist()
    return loss_sum / max(count, 1), correct / max(count, 1), int(count)


# ----------------------------------------------------------------------------- environment checks
# Each turns what would be a hang, or a traceback from every rank, into one line or a
# warning; none changes how training runs.

def gpus_torch_cannot_see(devices="/dev/nvidia[0-9]*"):
    """Why torch sees no GPU where this process may open an NVIDIA GPU's device, or None
    where torch sees one, or none may be opened (a container or a scheduler's job given no
    GPU), or CUDA_VISIBLE_DEVICES hides them all on purpose ("" or -1)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_available() or torch.version.hip or hidden in ("", "-1"):
        return None
    gpu = next((path for path in sorted(glob.glob(devices)) if may_open(path)), None)
    if gpu is None:
        return None
    if torch.version.cuda is None:
        return f"a GPU ({gpu}), but torch {torch.__version__} is a CPU-only build"
    shown = "" if hidden is None else f", or CUDA_VISIBLE_DEVICES={hidden} names none"
    return (f"a GPU ({gpu}), but torch {torch.__version__} (CUDA {torch.version.cuda}) sees "
            f"none: a driver too old for that CUDA, or updated without a reboot{shown}? "
            "(nvidia-smi tells)")


def torch_built_for(capability):
    """The GPU architectures this torch has kernels for ("sm_80 sm_90"), where none of
    them runs on a GPU of compute capability (major, minor), else "". A build that names
    none (ROCm's gfx names) is taken to fit."""
    built = [arch for arch in torch.cuda.get_arch_list() if ARCH_NAME.fullmatch(arch)]
    if not built or any(arch_runs_on(arch, capability) for arch in built):
        return ""
    return " ".join(built)


def arch_runs_on(arch, capability):
    """Whether kernels built for arch ("sm_80", "sm_90a", "compute_90") run on a GPU of
    capability (major, minor). Machine code for X.Y runs on X.Z, Z >= Y (sm_80's on an 8.6,
    not sm_75's on a 7.0); "a" code (sm_90a) on X.Y alone; PTX (compute_90), which the
    driver compiles, on X.Y and newer."""
    kind, number, suffix = ARCH_NAME.fullmatch(arch).groups()
    built = divmod(int(number), 10)
    if suffix == "a":
        return built == capability
    if kind == "compute" and not suffix:
        return built <= capability
    return built[0] == capability[0] and built[1] <= capability[1]  # (and "f": sm_100f)


def may_open(path):
    try:
        os.close(os.open(path, os.O_RDONLY))
        return True
    except OSError:  # absent, or denied (a cgroup that keeps a job from other jobs' GPUs)
        return False


def check_other_hosts_can_reach_gloo():
    """Without GLOO_SOCKET_IFNAME, gloo listens on the first address of this host's name
    that it can bind, or on 127.0.0.1. Debian and Ubuntu map the name to 127.0.1.1, and a
    job across hosts would fail on one of them at start-up and hang on the others."""
    if len(os.environ.get("GLOO_SOCKET_IFNAME", "")) > 1:  # torch ignores a shorter value
        return
    if is_loopback(os.environ["MASTER_ADDR"]):
        return  # every node on this machine, as in a test of two nodes on one box
    host = socket.gethostname()
    address = first_bindable_address(host) or "127.0.0.1"
    if is_loopback(address):
        raise UsageError(f"this host's name, {host}, gives gloo {address} to listen on, where "
                         f"no other host can reach it: map {host} to this host's address on the "
                         "cluster network in /etc/hosts, or set GLOO_SOCKET_IFNAME to the "
                         "interface that holds that address if it is not lo (launch.sh does)")


def is_loopback(address):
    """True for localhost and loopback addresses, False for other names."""
    try:
        return address == "localhost" or ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:  # a name; the % of fe80::1%eth0 begins a scope
        return False


def first_bindable_address(host):
    try:
        candidates = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):  # no address; a label of over 63 characters
        return None
    for family, kind, protocol, _, address in candidates:
        with socket.socket(family, kind, protocol) as probe:
            try:
                probe.bind(address)
                return address[0]
            except OSError:  # ::1 where IPv6 is off, an address this host does not hold
                continue
    return None


def check_compile_works(device):
    """torch.compile needs a compiler on the machine (C++ on CPU, C for Triton on GPU),
    among other things; where it cannot work, every rank would fail at its first step, in
    a long traceback. A one-line function compiled first says so before training, for a
    second or less beyond what the model's compile would spend anyway."""
    error = None
    try:
        torch.compile(lambda x: x + 1)(torch.ones(1, device=device))
    except Exception as e:
        first_line = (str(e).strip().splitlines() or [""])[0]
        fix = "drop --compile"
        if "compiler" in first_line.lower():
            fix = "install a C/C++ compiler (gcc, g++), or " + fix
        error = f"--compile cannot compile here ({type(e).__name__}: {first_line}): {fix}"
    stop_together(error)


def slow_amp(amp, device):
    """Why --amp amp runs slower than fp32 on device, or None."""
    if amp == "fp16" and device.type == "cpu":  # CPUs have few fast fp16 kernels
        return ("--amp fp16 on the CPU is many times slower than fp32 (45x for cnn on a 2-CPU "
                "VM); --amp bf16 is the fast one there")
    if amp == "bf16" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
        # No bf16 units before Ampere: torch emulates it, and cuDNN has no bf16
        # convolutions there, so they fall back to torch's own slow ones.
        return (f"--amp bf16 on a {torch.cuda.get_device_name(device)}, older than Ampere, "
                "is emulated and slow; --amp fp16 is the fast one there")
    return None


# ----------------------------------------------------------------------------- main

def log(line):
    """Print one line in one write. torchrun runs workers unbuffered (python -u), where
    print() writes the text and the newline apart, and another process's output sharing
    the stream can land in between."""
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except OSError:  # stdout is gone (a `| tee` closed with its terminal): lose lines, not the run
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # where the lines still buffered go, too
        os.close(devnull)


def log_restarts():
    """torchrun says nothing of a restart at its default log level, and counts restarts per
    node, only on a node whose workers failed: the others restart theirs uncounted."""
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if restarts > 0:
        log(f"torchrun on {socket.gethostname()} restarted its workers after failures there: "
            f"{restarts} of at most {os.environ['TORCHELASTIC_MAX_RESTARTS']} restarts used")


def format_seconds(seconds):
    return str(datetime.timedelta(seconds=round(seconds)))


def train(args, rank, local_rank, world_size, device):
    # Fix: the pattern seeded nothing. One seed on every rank while building what all ranks
    # must share (a random split of your data, say); then a stream per rank, to train.
    torch.manual_seed(args.seed)
    if device.type == "cpu":
        # Tiny gradients turn denormal on CPUs and slow every step several-fold.
        torch.set_flush_denormal(True)
    if local_rank == 0:
        log_restarts()
    check_same_args_everywhere(args)
    ckpt_path = checkpoint_path(args)
    prepare_outputs(args, ckpt_path, rank)
    data = build_data(args, rank, local_rank, device)
    check_data_layout(data)
    data_id = check_same_data_everywhere(data)  # in checkpoints too: resume needs the same data
    train_x, train_y, test_x, test_y = data

    model = build_model(args.arch).to(device)
    optimizer = build_optimizer(model, args)
    # Fix: the pattern built the deprecated torch.cuda.amp.GradScaler and never used it,
    # so it trained in plain fp32. fp16 needs the scaler; bf16 and fp32 pass through it.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    seed_rank_stream(args.seed, rank, 0)

    per_step = args.batch_size * args.accum_steps  # samples per rank per optimizer step
    samples_per_rank = len(epoch_order(len(train_x), 0, rank, world_size, args.seed))
    check_no_batch_of_one(model, samples_per_rank, args.batch_size)
    steps_per_epoch = -(-samples_per_rank // per_step)
    total_steps = args.epochs * steps_per_epoch
    if args.max_steps is not None:
        total_steps = min(total_steps, args.max_steps)

    step = 0
    checkpoint = (load_checkpoint(ckpt_path, args, data_id, optimizer, device, rank, world_size)
                  if ckpt_path else None)
    if checkpoint is not None:
        step = resume_from(checkpoint, ckpt_path, model, optimizer, scaler, args, device, rank,
                           world_size)

    ddp_model = wrap_ddp(model, device)
    if args.compile:
        check_compile_works(device)
        ddp_model = torch.compile(ddp_model)

    def save(step):  # every rank calls it: RNG states are gathered from all
        if ckpt_path:
            save_checkpoint(ckpt_path, model, optimizer, scaler, step // steps_per_epoch, step,
                            args, data_id, device, rank)

    run_start, run_start_step = time.perf_counter(), step

    def eta(step):
        seconds_per_step = (time.perf_counter() - run_start) / max(step - run_start_step, 1)
        return format_seconds((total_steps - step) * seconds_per_step)

    if rank == 0:
        log(f"start: world_size={world_size} "
            f"backend={dist.get_backend() if distributed() else 'none'} device={device} "
            f"arch={args.arch} dataset={args.dataset} amp={args.amp} global_batch="
            f"{per_step * world_size} steps_per_epoch={steps_per_epoch} total_steps={total_steps}")
        slow = slow_amp(args.amp, device)
        if slow:
            print(f"train.py: warning: {slow}", file=sys.stderr)
        if step >= total_steps:
            log(f"nothing to train: {ckpt_path} is at step {step}, and this run ends at step "
                f"{total_steps}")
    while step < total_steps:
        # This run trains the epoch's steps from done_in_epoch up to stop_in_epoch.
        epoch, done_in_epoch = divmod(step, steps_per_epoch)
        stop_in_epoch = min(steps_per_epoch, total_steps - epoch * steps_per_epoch)
        order = epoch_order(len(train_x), epoch, rank, world_size, args.seed)
        order = order[done_in_epoch * per_step:stop_in_epoch * per_step].to(device)
        end_step = epoch * steps_per_epoch + stop_in_epoch

        def after_step(n, loss_sum, samples, first=step):
            now = first + n  # optimizer steps done in total
            save_now = args.save_every and now % args.save_every == 0 and now < end_step
            log_now = args.log_every and now % args.log_every == 0 and rank == 0
            if not (save_now or log_now):
                return 0.0
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the steps queued so far are training time
            start = time.perf_counter()
            if save_now:
                save(now)  # the epoch's end saves after evaluating
            if log_now:
                log(f"epoch {epoch + 1}/{args.epochs} step {now}/{total_steps} "
                    f"loss(rank 0, epoch so far) {(loss_sum / samples).item():.4f} "
                    f"eta {eta(now)}")
            return time.perf_counter() - start

        train_loss, samples, seconds = train_one_epoch(
            ddp_model, optimizer, scaler, train_x, train_y, order, args, device, after_step)
        step = end_step
        test_loss, test_accuracy, test_samples = evaluate(model, test_x, test_y, args, device,
                                                          rank, world_size)
        error = None
        if rank == 0:
            partial = done_in_epoch > 0 or stop_in_epoch < steps_per_epoch  # resumed, or stopped
            row = {"epoch": epoch + 1, "step": step, "world_size": world_size,
                   "train_loss": train_loss, "test_loss": test_loss,
                   "test_accuracy": test_accuracy, "test_samples": test_samples,
                   "samples_per_sec": samples / seconds, "partial": partial}
            # A resumed or shortened epoch's figures are of the steps this run trained.
            covered = (f" (its steps {done_in_epoch + 1}-{stop_in_epoch} of {steps_per_epoch})"
                       if partial else "")
            log(f"epoch {epoch + 1}/{args.epochs}{covered} step {step} "
                f"train_loss {train_loss:.4f} test_loss {test_loss:.4f} "
                f"test_acc {100 * test_accuracy:.2f}% {samples / seconds:.0f} samples/s "
                f"eta {eta(step)}")
            if args.metrics:
                line = json.dumps(row)
                try:
                    with open(args.metrics, "a") as f:
                        f.write(line + "\n")
                except OSError as e:  # a full disk, say
                    error = f"cannot append to {args.metrics}: {e.strerror}; the row: {line}"
        save(step)  # after the metrics row: a crash in between repeats the row, never loses it
        stop_together(error)  # after the save, so the epoch is kept; the error holds its row
    return model


def main(argv=None):
    """Train and return the (unwrapped) model, for scripts that import train.py. A rank of
    a distributed run that fails ends its process."""
    args = parse_args(argv)
    try:
        rank, local_rank, world_size, device = setup_distributed(args)
        return train(args, rank, local_rank, world_size, device)
    except UsageError as e:  # raised before the process group exists
        let_local_rank_0_speak()
        print_errors([e])
        sys.exit(1)
    except KeyboardInterrupt:  # Ctrl-C: one line from rank 0, not a traceback from each rank
        try:
            if int(os.environ.get("RANK", 0)) == 0:
                last = checkpoint_path(args)
                resume = (f": the same command resumes from {last}"
                          if last and os.path.exists(last) else "")
                print(f"train.py: interrupted{resume}", file=sys.stderr, flush=True)
        finally:
            if distributed():  # out at once, as below: the teardown can wait for the others
                os._exit(130)
        sys.exit(130)
    except Exception as e:
        if not distributed():
            raise
        # Out at once, without the teardown below (or Python's), even where stderr is gone:
        # under nccl, the teardown can wait for collectives that the other ranks never
        # finish, and then this rank's error never shows and torchrun never sees it fail.
        try:
            if isinstance(e, RuntimeError) and any(text in str(e) for text in LOST_PEER_TEXTS):
                # Likely another rank failed first, or the job is being stopped. Wait, so
                # that rank's node exits first (launch.sh names it), then print one line,
                # not a traceback that buries that rank's.
                time.sleep(3)
                print_errors([f"rank {dist.get_rank()} lost a peer (it closed the connection, "
                              f"or stayed away past --timeout): {describe(e)}"])
            else:
                sys.excepthook(*sys.exc_info())  # torch's: each line starts [rankN]
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(1)
    finally:
        # Fix: the pattern never destroyed its process group.
        if distributed():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Done, and the process group destroyed. Skip the interpreter's C++ teardown: with
    # gloo, torch 2.14 aborts there now and then ("terminate called without an active
    # exception", about 1 run in 20 at 3 ranks), and torchrun would fail the finished job.
    # atexit handlers do not run either: close your loggers (wandb, TensorBoard) before.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
