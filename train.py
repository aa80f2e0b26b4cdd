"""Train an MNIST classifier with DistributedDataParallel, on one process or many.

    python train.py --arch cnn --dataset synthetic          # one process
    torchrun --standalone --nproc_per_node=2 train.py       # one machine
    ./launch.sh hosts.txt 4    or    sbatch -N 2 train.sbatch 4    # many machines

One code path serves them all (without torchrun, a world of one). It is the torchrun + DDP
tutorial's pattern with its bugs fixed, each marked "Fix:" where it happens. With
--checkpoint-dir DIR a run resumes from DIR/last.pt after any crash, bitwise equal to a run
never stopped (on CPU, at the same world size).

To train your own data and model, edit:
    build_data       an entry in DATASETS: how to download it (run once per node) and read it
                     (uint8 images (N, C, H, W), int64 labels), its per-channel mean and std
    build_model      an entry in MODELS: a function of (channels, classes)
    build_optimizer  the optimizer (a scheduler of yours goes into the checkpoint too)
    normalize        uint8 images to the model's input
"""
import argparse
import contextlib
import ctypes
import datetime
import json
import math
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

EVAL_BATCH_SIZE = 1024
PROGRESS_SECONDS = 10  # rank 0 prints a progress line this often, unless --log-every
MNIST_FILES = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte",
               "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
# Arguments a resumed run may change; all others (yours too) must match the checkpoint's.
MAY_CHANGE_ON_RESUME = {"data", "no_download", "epochs", "max_steps", "backend", "timeout",
                        "compile", "checkpoint_dir", "save_every", "log_every", "metrics"}


# ----------------------------------------------------------------------------- arguments
def positive_int(text):
    if int(text) <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return int(text)


class Parser(argparse.ArgumentParser):
    def error(self, message):
        if int(os.environ.get("LOCAL_RANK", 0)) > 0:
            time.sleep(10)  # every rank has this error: local rank 0 says it, torchrun ends us
        self.exit(2, f"train.py: error: {message} (see --help)\n")


def parse_args(argv=None):
    p = Parser(epilog="examples:\n" + __doc__.split("\n\n")[1], description=__doc__.split("\n")[0],
               formatter_class=type("Formatter", (argparse.RawDescriptionHelpFormatter,
                                                  argparse.ArgumentDefaultsHelpFormatter), {}))
    p.add_argument("--dataset", choices=DATASETS, default="mnist", help="synthetic: no download")
    p.add_argument("--data", default="./data", help="directory that holds (or gets) MNIST/raw")
    p.add_argument("--no-download", action="store_true", help="fail if MNIST's files are missing")
    p.add_argument("--arch", choices=MODELS, default="resnet18", help="cnn: small, for CPUs")
    # Fix: the pattern looped over an undefined `epochs`.
    p.add_argument("--epochs", type=positive_int, default=2, help="epochs of the whole run")
    p.add_argument("--max-steps", type=positive_int, help="stop here, if before --epochs' end")
    p.add_argument("--batch-size", type=positive_int, default=64, help="samples per process")
    p.add_argument("--accum-steps", type=positive_int, default=1, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=0.01, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the data order")
    p.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none", help="fp16: scaled")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto",
                   help="auto: nccl where torch sees a GPU, else gloo (on the CPU)")
    p.add_argument("--timeout", type=positive_int, default=300, help="seconds to wait for a peer")
    p.add_argument("--checkpoint-dir", help="save DIR/last.pt, and resume from it if there")
    p.add_argument("--save-every", type=positive_int, help="also save every N optimizer steps")
    p.add_argument("--log-every", type=positive_int, help="a progress line every N steps")
    p.add_argument("--metrics", help="append one JSON line per epoch to this file")
    args = p.parse_args(argv)
    if args.save_every and not args.checkpoint_dir:
        p.error("--save-every needs --checkpoint-dir")
    if "" in (args.data, args.checkpoint_dir, args.metrics):  # `--checkpoint-dir "$UNSET"`
        p.error("a path must not be empty")
    return args


# ----------------------------------------------------------------------------- distributed
def setup_distributed(args):
    """(rank, world_size, device), in a process group: torchrun's, else one of a single rank."""
    if sys.platform == "linux" and "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun starts workers in sessions of their own: end with it, even at its kill -9.
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    # Fix: the pattern used LOCAL_RANK as the rank, so each node's first process acted as rank 0.
    rank, local_rank = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    auto = "nccl" if torch.cuda.is_available() else "gloo"
    backend = auto if args.backend == "auto" else args.backend
    device = torch.device("cpu")  # Fix: .cuda(rank) crashed on machines without a GPU
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        # Fix: the pattern never called set_device, so NCCL put every process on GPU 0.
        torch.cuda.set_device(device)
    alone = {} if "RANK" in os.environ else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=device if backend == "nccl" else None, **alone)
    return rank, dist.get_world_size(), device


def all_gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def stop_if_any(error):
    """Every rank calls this: if any has an error, each says its own (once per node); all exit."""
    errors = all_gather(error)
    if any(errors):
        rank, local_rank = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0))
        if error and error not in errors[rank - local_rank:rank]:
            print(f"train.py: error: {error}", file=sys.stderr)
        raise SystemExit(1)


# ----------------------------------------------------------------------------- data
def read_idx(path):
    """A uint8 tensor from one of MNIST's idx files (2 zero bytes, 8, ndim, the sizes)."""
    with open(path, "rb") as f:
        data = f.read()
    ndim = data[3] if len(data) > 3 else 0
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    if data[:3] != b"\0\0\x08" or len(data) != 4 + 4 * ndim + math.prod(shape):
        raise ValueError(f"{path} is not a whole idx file of uint8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=4 + 4 * ndim).view(shape)


def download_mnist(args):
    import torchvision
    for train in (True, False):
        torchvision.datasets.MNIST(args.data, train=train, download=True)


def mnist(args):
    """MNIST's four files from --data/MNIST/raw (torchvision's layout)."""
    x, y, test_x, test_y = (read_idx(os.path.join(args.data, "MNIST", "raw", name))
                            for name in MNIST_FILES)
    return x.unsqueeze(1), y.long(), test_x.unsqueeze(1), test_y.long()


def synthetic(args=None, sizes=(60_000, 10_000)):
    """MNIST's shapes, learnable: each class a fixed pattern in noise. (Images, labels) x 2."""
    patterns = torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(0)) > 0.85
    data = []
    for seed, samples in enumerate(sizes, start=1):
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, 10, (samples,), generator=g)
        noise = torch.randint(0, 192, (samples, 1, 28, 28), generator=g, dtype=torch.uint8)
        data += [noise + patterns[labels].to(torch.uint8) * 64, labels]
    return data


DATASETS = {  # name: (download, or None; read; per-channel mean; std)
    # Fix: the pattern normalised MNIST with (0.5, 0.5), not with its own mean and std.
    "mnist": (download_mnist, mnist, [0.1307], [0.3081]),
    "synthetic": (None, synthetic, [0.4115], [0.2348]),
}


def build_data(args, device):
    """The data set on the device, and its per-channel mean and std as (C, 1, 1) tensors."""
    download, read, mean, std = DATASETS[args.dataset]
    rank, local_rank, error = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), None
    # Fix: all ranks downloaded into the same files at once. Here rank 0, then each node's first.
    for my_turn in (rank == 0, local_rank == 0 and rank != 0):
        if my_turn and download and not args.no_download and error is None:
            try:
                download(args)
            except Exception as e:  # offline, a mirror down, a full disk ...
                error = f"download failed: {type(e).__name__}: {' '.join(str(e).split())}"
        errors = all_gather(error)  # the others wait here, up to --timeout
        error = errors[0] or errors[rank - local_rank]
    try:
        data = None if error else read(args)
    except (OSError, ValueError) as e:
        error = str(e)
    stop_if_any(error and f"--dataset {args.dataset} unavailable on {os.uname().nodename} "
                          f"({error}): see --data and --no-download, or use --dataset synthetic")
    # Fix: 8 DataLoader workers per rank decoded images; indexing one tensor is many times faster.
    data = [t.to(device) for t in data]
    return data, torch.tensor([mean, std], device=device)[:, :, None, None]


def normalize(images, mean, std):
    return (images.float() / 255 - mean) / std


def epoch_order(samples, epoch, rank, world_size, seed):
    """This rank's sample indices for one epoch: DistributedSampler's shard."""
    sampler = DistributedSampler(range(samples), world_size, rank, shuffle=True, seed=seed)
    # Fix: without set_epoch every epoch repeats the first one's order.
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler))


# ----------------------------------------------------------------------------- model
def cnn(channels, classes, size=28):
    """Small and fast, for CPUs: two convolutions, for size x size images (MNIST's 28)."""
    return nn.Sequential(nn.Conv2d(channels, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(32 * (size // 4) ** 2, classes))


def resnet18(channels, classes):
    import torchvision
    # Fix: resnet18(pretrained=False) is deprecated, and its 3-channel stem fails on MNIST.
    model = torchvision.models.resnet18(weights=None, num_classes=classes)
    model.conv1 = nn.Conv2d(channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    return model


MODELS = {"cnn": cnn, "resnet18": resnet18}


def build_model(args, channels, classes):
    return MODELS[args.arch](channels, classes)


def why_data_does_not_fit(args, model, images, stats, classes):
    """Why normalize or the model cannot take the data set's images, or None."""
    data = f"--dataset {args.dataset}'s images, {images.dtype} {tuple(images.shape)},"
    if images.dtype != torch.uint8 or images.dim() != 4 or len(stats[0]) != images.shape[1]:
        return f"{data} do not fit normalize: give it uint8 (N, C, H, W), and C means and stds"
    try:
        with torch.no_grad():
            shape = tuple(model.eval()(normalize(images[:2], *stats)).shape)
    except RuntimeError as e:
        shape = str(e).splitlines()[0]
    model.train()
    return shape != (2, classes) and f"{data} do not fit --arch {args.arch} ({shape}): see MODELS"


def build_optimizer(model, args):
    return torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)


def wrap_ddp(model, device):
    if dist.get_world_size() == 1:
        return model
    # A model with parameters that get no gradient in some steps needs find_unused_parameters.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              gradient_as_bucket_view=True)
    if dist.get_backend() == "gloo":
        # For bitwise resume: DDP's layout after step 1, now (it changes gloo's sums at 3+ ranks).
        ddp.reducer._push_all_rebuilt_params()
        ddp.reducer._rebuild_buckets()
    return ddp


# ----------------------------------------------------------------------------- checkpoints
def save_checkpoint(path, model, optimizer, scaler, step, args, device):
    """Every rank calls it (for its RNG state); rank 0 writes `path` atomically."""
    # Fix: the pattern saved nothing, so a crash lost the whole run.
    rng = all_gather({"cpu": torch.get_rng_state(),
                      "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None})
    error, tmp = None, path + ".tmp"
    if dist.get_rank() == 0:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                 "scaler": scaler.state_dict(), "step": step, "rng": rng, "args": vars(args)}
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                torch.save(state, f)
                os.fsync(f.fileno())  # on disk before the rename: a crash leaves old or new
            os.replace(tmp, path)
        except (OSError, RuntimeError) as e:  # torch.save wraps a full disk in a RuntimeError
            cause = e if isinstance(e, OSError) else e.__context__
            error = f"cannot write {tmp}: {getattr(cause, 'strerror', e)}; {path} is as it was"
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
    stop_if_any(error)


def load_checkpoint(path):
    """The checkpoint at `path` (tensors left on disk till used), None, or why it is unreadable."""
    if not os.path.exists(path):
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, corrupt, not a checkpoint: never start over silently
        return f"is unreadable on {os.uname().nodename} ({type(e).__name__}): move it away"


def why_not_resumable(state, args):
    if not isinstance(state, dict) or not {"model", "step", "rng", "args"} <= state.keys():
        return "is not train.py's: move it away, or use another --checkpoint-dir"
    theirs = {**state["args"], "world size": len(state["rng"])}
    changed = [f"{k if k == 'world size' else '--' + k.replace('_', '-')} {theirs.get(k)} "
               f"(now {v})" for k, v in {**vars(args), "world size": dist.get_world_size()}.items()
               if k not in MAY_CHANGE_ON_RESUME and theirs.get(k) != v]
    return changed and (f"was written by a run with {', '.join(changed)}: resume with the same, "
                        "or use another --checkpoint-dir")


def resume(path, model, optimizer, scaler, args, device):
    """Load the newest last.pt of any node (they may share no disk) into every rank; its step."""
    state = load_checkpoint(path)
    stop_if_any(isinstance(state, str) and f"checkpoint {path} {state}")
    steps = all_gather(-1 if state is None else state.get("step", 0) if isinstance(state, dict)
                       else 0)
    if max(steps) < 0:
        return 0
    if len(set(steps)) > 1:  # not one shared file: the newest goes to every rank
        dist.broadcast_object_list(box := [state], src=steps.index(max(steps)))
        state = box[0]
    error = why_not_resumable(state, args)
    if not error:
        try:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scaler.load_state_dict(state["scaler"])
        except (RuntimeError, ValueError, KeyError) as e:  # the model's or optimizer's code changed
            error = f"does not fit this model ({type(e).__name__}): use another --checkpoint-dir"
    stop_if_any(error and f"checkpoint {path} {error}")
    rng = state["rng"][dist.get_rank()]
    torch.set_rng_state(rng["cpu"])
    if device.type == "cuda" and rng["cuda"] is not None:
        torch.cuda.set_rng_state(rng["cuda"], device)
    return state["step"]


# ----------------------------------------------------------------------------- train and evaluate
def autocast(args, device):
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def train_step(ddp_model, optimizer, scaler, data, stats, indices, args):
    """One optimizer step on samples `indices`, in micro-batches; returns their loss sum."""
    train_x, train_y = data[:2]
    loss_sum, micro_batches = 0, indices.split(args.batch_size)
    for i, idx in enumerate(micro_batches):
        sync = i == len(micro_batches) - 1 or dist.get_world_size() == 1  # the others accumulate
        with contextlib.nullcontext() if sync else ddp_model.no_sync():
            with autocast(args, train_x.device):
                loss = F.cross_entropy(ddp_model(normalize(train_x[idx], *stats)), train_y[idx])
            # Each micro-batch weighs by its share of the step: the epoch's last may be short.
            scaler.scale(loss * (len(idx) / len(indices))).backward()
        loss_sum += loss.detach() * len(idx)  # no .item(): the loop never waits for the GPU
    scaler.step(optimizer)  # skips the step where fp16 gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum


@torch.no_grad()
def evaluate(model, data, stats, args):
    """Exact (loss, accuracy, samples) over the test set, each sample counted once by one rank."""
    # Fix: the pattern never evaluated, so nothing said whether training worked.
    # The unwrapped model (DDP's forward is a collective), with rank 0's BatchNorm statistics.
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    test_x, test_y = data[2:]
    totals = torch.zeros(3, device=test_x.device, dtype=torch.float64)
    mine = torch.arange(dist.get_rank(), len(test_x), dist.get_world_size(), device=test_x.device)
    for idx in mine.split(EVAL_BATCH_SIZE):
        with autocast(args, test_x.device):
            logits = model(normalize(test_x[idx], *stats))
        totals[0] += F.cross_entropy(logits.float(), test_y[idx], reduction="sum")
        totals[1] += (logits.argmax(1) == test_y[idx]).sum()
        totals[2] += len(idx)
    model.train()
    dist.all_reduce(totals)
    loss_sum, correct, count = totals.tolist()
    return loss_sum / max(count, 1), correct / max(count, 1), int(count)


def report_epoch(args, row, eta):
    """Rank 0's epoch line and metrics row; returns an error for stop_if_any, or None."""
    print(f"epoch {row['epoch']}/{args.epochs} step {row['step']} train_loss "
          f"{row['train_loss']:.4f} test_loss {row['test_loss']:.4f} test_acc "
          f"{100 * row['test_accuracy']:.2f}% {row['samples_per_sec']:.0f} samples/s eta {eta}")
    if args.metrics:
        try:
            with open(args.metrics, "a") as f:
                f.write(json.dumps(row) + "\n")
        except OSError as e:  # a full disk, say; the epoch is saved next
            return f"cannot append to {args.metrics}: {e.strerror}; the row: {json.dumps(row)}"


def eta(seconds, steps_done, steps_left):
    return datetime.timedelta(seconds=round(seconds / max(steps_done, 1) * steps_left))


def setup_training(args, rank, device):
    """Data, mean and std, model, its DDP wrapper, optimizer, scaler, and the step to start at."""
    # Fix: the pattern seeded nothing. Every rank builds the same model from --seed.
    torch.manual_seed(args.seed)
    if device.type == "cpu":
        torch.set_flush_denormal(True)  # denormal gradients slow CPU steps several-fold
    data, stats = build_data(args, device)
    classes = int(max(data[1].max(), data[3].max())) + 1
    model = build_model(args, data[0].shape[1], classes).to(device)
    stop_if_any(why_data_does_not_fit(args, model, data[0], stats, classes))
    optimizer = build_optimizer(model, args)
    # Fix: the pattern built a GradScaler and never used it, so it trained in fp32.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    torch.manual_seed(args.seed + rank * 2**32)  # then a stream per rank, for dropout and such
    step = 0
    if args.checkpoint_dir:
        path = os.path.join(args.checkpoint_dir, "last.pt")
        step = resume(path, model, optimizer, scaler, args, device)
        if rank == 0 and step:
            print(f"resumed from {path} at step {step}")
    ddp_model = torch.compile(wrap_ddp(model, device)) if args.compile else wrap_ddp(model, device)
    return data, stats, model, ddp_model, optimizer, scaler, step


def train(args, rank, world_size, device):
    data, stats, model, ddp_model, optimizer, scaler, step = setup_training(args, rank, device)
    ckpt = args.checkpoint_dir and os.path.join(args.checkpoint_dir, "last.pt")
    per_step = args.batch_size * args.accum_steps
    steps_per_epoch = -(-len(epoch_order(len(data[0]), 0, rank, world_size, 0)) // per_step)
    total = min(args.epochs * steps_per_epoch, args.max_steps or math.inf)
    if ckpt and not step:  # a path that cannot be written fails now, not after an epoch
        save_checkpoint(ckpt, model, optimizer, scaler, 0, args, device)
    start, start_step, last_line, accuracy = time.perf_counter(), step, time.perf_counter(), None
    if rank == 0:
        print(f"start: world_size={world_size} backend={dist.get_backend()} device={device} "
              f"arch={args.arch} dataset={args.dataset} amp={args.amp} global_batch="
              f"{per_step * world_size} steps_per_epoch={steps_per_epoch} total_steps={total}")
    while step < total:
        epoch, done = divmod(step, steps_per_epoch)
        stop = min(steps_per_epoch, total - epoch * steps_per_epoch)
        order = epoch_order(len(data[0]), epoch, rank, world_size, args.seed).to(device)
        loss_sum, samples, epoch_start = 0, 0, time.perf_counter()
        for indices in order[done * per_step:stop * per_step].split(per_step):
            loss_sum += train_step(ddp_model, optimizer, scaler, data, stats, indices, args)
            samples, step = samples + len(indices), step + 1
            if args.save_every and step % args.save_every == 0 and step % steps_per_epoch:
                save_checkpoint(ckpt, model, optimizer, scaler, step, args, device)
            due = time.perf_counter() - last_line >= PROGRESS_SECONDS
            if rank == 0 and (step % args.log_every == 0 if args.log_every else due):
                last_line = time.perf_counter()
                left = eta(last_line - start, step - start_step, total - step)
                print(f"epoch {epoch + 1}/{args.epochs} step {step}/{total} "  # note: .item() syncs
                      f"loss {loss_sum.item() / samples:.4f} eta {left}")
        totals = torch.stack([loss_sum, loss_sum.new_tensor(samples)])
        dist.all_reduce(totals)
        loss_sum, samples = totals.tolist()  # note: waits for the GPU, so the time is right
        seconds = time.perf_counter() - epoch_start
        test_loss, accuracy, test_samples = evaluate(model, data, stats, args)
        row = {"epoch": epoch + 1, "step": step, "world_size": world_size,
               "train_loss": loss_sum / samples, "test_loss": test_loss, "test_accuracy": accuracy,
               "test_samples": test_samples, "samples_per_sec": samples / seconds,
               "partial": done > 0 or stop < steps_per_epoch}
        left = eta(time.perf_counter() - start, step - start_step, total - step)
        error = report_epoch(args, row, left) if rank == 0 else None
        if ckpt:  # after the metrics row: a crash between repeats the row, never loses it
            save_checkpoint(ckpt, model, optimizer, scaler, step, args, device)
        stop_if_any(error)
    if rank == 0:
        wall = datetime.timedelta(seconds=round(time.perf_counter() - start))
        saved = f"checkpoint {ckpt}" if ckpt else "no checkpoint saved (see --checkpoint-dir)"
        print(f"done: step {step}/{total} in {wall}, test_acc "
              f"{'-' if accuracy is None else f'{100 * accuracy:.2f}%'}, {saved}")
    return model


def main(argv=None):
    """Train, and return the unwrapped model (for scripts that import train.py)."""
    args = parse_args(argv)
    getattr(sys.stdout, "reconfigure", lambda **_: 0)(line_buffering=True)  # each line at once
    try:
        return train(args, *setup_distributed(args))
    except KeyboardInterrupt:  # Ctrl-C: one line from rank 0, not a traceback from each rank
        if int(os.environ.get("RANK", 0)) == 0:
            print("train.py: interrupted" + (": the same command resumes from the last checkpoint"
                                             if args.checkpoint_dir else ""), file=sys.stderr)
        os._exit(130)  # without the process group's teardown, which may wait for peers
    except Exception:
        if int(os.environ.get("WORLD_SIZE", 1)) == 1:
            raise
        # Out at once: under nccl the teardown can wait for peers that never come.
        sys.excepthook(*sys.exc_info())
        os._exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()  # Fix: the pattern never destroyed its process group


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # then skip the C++ teardown, where gloo may abort a finished run
    os._exit(0)
