#!/usr/bin/env python3
"""Check that hosts can run a multi-node PyTorch job together, before you launch one.

  python check_env.py                            report on this machine
  python check_env.py --json                     the same report as JSON
  python check_env.py --hosts hosts.txt          compare every host in hosts.txt
  python check_env.py --hosts hosts.txt --nproc 4
                                                 ... and check each host has 4 GPUs
  python check_env.py --hosts hosts.txt --allreduce
                                                 ... then time all-reduce across them
  python check_env.py --allreduce --nproc 8      time all-reduce between 8 processes here

Remote hosts are reached with SSH_COMMAND (default "ssh", split on spaces, with
no quoting) in BatchMode. The report runs there by streaming this
file to the remote interpreter, so nothing needs to be installed on the hosts.
--allreduce is the exception: torchrun needs a file, so it needs check_env.py
at the same absolute path on every host (a shared filesystem or the same image).

hosts.txt holds one "[user@]host[:port]" per line; "#" starts a comment.
"localhost" and this machine's own name or address are checked without SSH.

Exit status: 0 when the hosts match, 1 when a problem was found (each one is
printed on its own line), 2 for a usage error such as a malformed hosts file.

Needs Python 3.10+ and the standard library; torch is imported only inside the
report, so a host without torch is reported, not crashed on.
"""

import sys

if sys.version_info < (3, 10):  # say so, where `--python python3` finds an old one
    sys.exit(f"check_env.py needs Python 3.10 or newer, and this is {'.'.join(map(str, sys.version_info[:3]))}")

import argparse
import base64
import contextlib
import ctypes
import errno
import ipaddress
import json
import os
import platform
import re
import resource
import secrets
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

STARTED = time.time()  # this host's clock as the report began: see fetch_report
CONNECT_TIMEOUT_S = 5  # ssh -o ConnectTimeout: an unreachable host fails fast
REPORT_TIMEOUT_S = 90  # a cold `import torch` on a network filesystem can be slow
PATIENCE_S = 10  # then check_env.py names the hosts it is still waiting for
FIRST_ALONE_S = 5  # for a login to the first remote host, before the others: see fetch_reports
CAP_IPC_LOCK = 14  # its bit in /proc/self/status's CapEff: RDMA may pin memory past ulimit -l
ARCH_NAME = re.compile(r"(sm|compute)_(\d+)([af]?)")  # in torch.cuda.get_arch_list()

# All-reduce benchmark. Every wait is bounded so that a node that cannot reach
# the others ends the run with a message instead of hanging it.
ALLREDUCE_SIZES = [1024 * 4**i for i in range(9)]  # 1 KiB .. 64 MiB, as nccl-tests' -b 1K -e 64M -f 4
ALLREDUCE_SIZES_NCCL = ALLREDUCE_SIZES + [256 * 2**20, 2**30]  # NVLink and InfiniBand near their peak
ALLREDUCE_SLOW_S = 0.05  # ... unless a size from 64 MiB up took longer (10 GbE takes 0.1 s for 64 MiB)
ALLREDUCE_BYTES_PER_SIZE = 256 * 2**20  # iterations per size: about this many bytes, 3..20 of them
ALLREDUCE_WARMUPS = 3  # untimed all-reduces per size: the first sets up the connections' buffers
RDZV_READ_TIMEOUT_S = 10  # torchrun gives up connecting to the rendezvous store after this
RDZV_JOIN_TIMEOUT_S = 30  # ... and waiting for the other nodes to join after this
COLLECTIVE_TIMEOUT_S = 30  # init_process_group: a lost peer fails the collective
ALLREDUCE_DEADLINE_S = 90  # the whole run, start-up included; then every node is stopped
TORCHRUN_STOP_S = 5  # a node stopping: from SIGTERM to torchrun until SIGKILL
NODE_STOP_S = TORCHRUN_STOP_S + 5  # from closing a node's stdin until SIGKILL of its ssh
RESULT_MARKER = "CHECK_ENV_ALLREDUCE "  # prefixes rank 0's result line in the torchrun output

# What launch.sh gives every host from this shell (its FORWARDED): the hosts are
# checked, and benchmarked, with what the job will see.
FORWARDED = re.compile(r"NCCL_.*|GLOO_.*|TORCH_.*|OMP_NUM_THREADS|CUDA_VISIBLE_DEVICES|PYTHONPATH")
SHOWN_ENV = re.compile(rf"MASTER_.*|{FORWARDED.pattern}")  # the report's env row

# Linux ioctls that return an interface's IPv4 address and netmask (<linux/sockios.h>).
SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B


# --------------------------------------------------------------------------
# The report on one machine. This part also runs on remote hosts, streamed
# through ssh, so it must not assume torch, a GPU or anything but the stdlib.
# --------------------------------------------------------------------------


def gather_report():
    """Everything about this machine that decides whether it can join a job.

    A value that cannot be had is None, with the reason in report["why_missing"].
    """
    why_missing = {}
    if "SSH_CONNECTION" not in os.environ:
        why_missing["ssh_connection"] = "not run over SSH"
    return {
        "hostname": socket.gethostname(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        **torch_facts(why_missing),
        "driver": nvidia_driver_version(why_missing),
        "interfaces": interface_addresses(why_missing),
        "rdma_devices": rdma_devices(),
        "rdma_ports_inactive": rdma_ports_inactive(),
        "locked_memory": locked_memory_limit(),
        "env": {k: v for k, v in sorted(os.environ.items()) if SHOWN_ENV.fullmatch(k)},
        # "client-address client-port server-address server-port" when run over SSH: the
        # server address is where this host was reached, and where the job will reach it.
        "ssh_connection": os.environ.get("SSH_CONNECTION"),
        "clock": [STARTED, time.time()],  # this host's, as the report began and ended
        "why_missing": why_missing,
    }


def torch_facts(why_missing):
    """Versions, backends and GPUs as torch sees them; None where torch cannot tell."""
    facts = dict.fromkeys(["torch", "torchvision", "cuda_runtime", "cudnn", "nccl", "gloo_available", "nccl_available"])
    facts["gpus"] = []
    try:
        # Imported here, not at the top: a host without torch must still report.
        import torch
        import torch.distributed as dist
    except Exception as exc:  # not only ImportError: a broken install can raise anything
        why_missing.update(dict.fromkeys(facts, "no torch"), torch=f"does not import: {describe(exc)}")
        return facts
    facts["torch"] = torch.__version__
    facts["cuda_runtime"] = torch.version.cuda
    if facts["cuda_runtime"] is None:
        why_missing["cuda_runtime"] = "CPU-only torch build"
    try:
        # Initialises CUDA, and raises where cuDNN does not support a GPU (below sm 7.5
        # for cuDNN 9.11+) or the driver is too old.
        cudnn = torch.backends.cudnn.version()
    except Exception as exc:
        cudnn, why_missing["cudnn"] = None, describe(exc)
    else:
        facts["cudnn"] = cudnn_version_string(cudnn) if cudnn else None
        if cudnn is None:
            why_missing["cudnn"] = "torch has no cuDNN"
    try:
        facts["nccl"] = nccl_version(torch)
    except Exception as exc:  # CPU-only builds have no NCCL to ask
        why_missing["nccl"] = describe(exc)
    facts["gloo_available"] = dist.is_available() and dist.is_gloo_available()
    facts["nccl_available"] = dist.is_available() and dist.is_nccl_available()
    # device_count() is 0, not an error, without a GPU or with CUDA_VISIBLE_DEVICES="".
    try:
        arch_list = torch.cuda.get_arch_list()
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpu = {
                "name": props.name,
                "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": f"{props.major}.{props.minor}",
                "torch_has_kernels": has_kernels_for((props.major, props.minor), arch_list),
            }
            try:
                # Starts a context there, as a job's first CUDA call does: that fails on a GPU
                # that another process holds in exclusive mode, or one that needs a reset.
                gpu["free_gib"] = round(torch.cuda.mem_get_info(i)[0] / 2**30, 1)
            except Exception as exc:
                gpu["error"] = describe(exc)
            facts["gpus"].append(gpu)
    except Exception as exc:  # a driver too old for this torch, MIG without CUDA_VISIBLE_DEVICES
        facts["gpus"], why_missing["gpus"] = [], describe(exc)
    if not facts["gpus"] and "gpus" not in why_missing:
        unusable = gpus_torch_cannot_use(torch)
        if unusable:
            why_missing["gpus"] = unusable
    try:
        import torchvision

        facts["torchvision"] = torchvision.__version__
    except Exception as exc:
        why_missing["torchvision"] = f"torchvision does not import: {describe(exc)}"
    return facts


def gpus_torch_cannot_use(torch, dev=Path("/dev")):
    """Why torch sees no GPU where this process may open an NVIDIA GPU's device, or None
    where none may be opened (a container or a scheduler's job given none), or
    CUDA_VISIBLE_DEVICES hides them all on purpose ("" or -1). torch counts 0 GPUs, and
    raises nothing, where the driver fails: updated without a reboot, say. (train.py's
    --backend auto refuses the same; each file stands alone, so each has its own copy.)"""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.hip or hidden in ("", "-1"):
        return None
    gpu = next((path for path in sorted(dev.glob("nvidia[0-9]*")) if may_open(path)), None)
    if gpu is None:
        return None
    if torch.version.cuda is None:
        return f"{gpu} is here, but torch {torch.__version__} is a CPU-only build"
    try:
        torch.cuda.init()  # raises what the count kept to a warning
    except Exception as exc:
        return f"{gpu} is here, but {describe(exc)}" + ("" if hidden is None else f" (CUDA_VISIBLE_DEVICES={hidden})")
    return None


def may_open(path):
    try:
        os.close(os.open(path, os.O_RDONLY))
        return True
    except OSError:  # absent, or denied (a cgroup that keeps a job from other jobs' GPUs)
        return False


def has_kernels_for(capability, arch_list):
    """Whether a torch built for arch_list (["sm_80", "sm_90a", "compute_90", ...]) runs on a
    GPU of compute capability (major, minor); a list with none of these (ROCm's gfx names)
    is taken to fit."""
    built = [arch for arch in arch_list if ARCH_NAME.fullmatch(arch)]
    return not built or any(arch_runs_on(arch, capability) for arch in built)


def arch_runs_on(arch, capability):
    """Whether kernels built for arch run on a GPU of capability (major, minor). Machine code
    for X.Y runs on X.Z, Z >= Y (sm_80's on an 8.6, not sm_75's on a 7.0); "a" code (sm_90a)
    on X.Y alone; PTX (compute_90), which the driver compiles, on X.Y and newer. (train.py
    has the same, to refuse such a GPU: each file stands alone.)"""
    kind, number, suffix = ARCH_NAME.fullmatch(arch).groups()
    built = divmod(int(number), 10)
    if suffix == "a":
        return built == capability
    if kind == "compute" and not suffix:
        return built <= capability
    return built[0] == capability[0] and built[1] <= capability[1]  # (and "f": sm_100f)


def nccl_version(torch, maps=Path("/proc/self/maps")):
    """The version of the NCCL library this process loaded, where torch loads one, else of
    the NCCL torch was built with. torch.cuda.nccl.version() gives the latter alone, alike
    on every host, even where one loads another (a pip install -U nvidia-nccl-cu13), and
    NCCL refuses to start with another version on another host."""
    mapped = ""
    with contextlib.suppress(OSError):  # no /proc: macOS
        mapped = maps.read_text()
    # Each line: address, permissions, offset, device, inode, then the path, spaces and all.
    loaded = re.search(r"^(?:\S+\s+){5}(/.*/libnccl\.so[.\d]*)$", mapped, re.M)
    if loaded is None:
        return ".".join(map(str, torch.cuda.nccl.version()))
    number = ctypes.c_int()
    if ctypes.CDLL(loaded[1]).ncclGetVersion(ctypes.byref(number)) != 0:  # not ncclSuccess
        raise RuntimeError(f"ncclGetVersion failed in {loaded[1]}")
    return nccl_version_string(number.value)


def nccl_version_string(number):
    """23007 -> "2.30.7". NCCL from 2.9 encodes its version as M*10000+m*100+p, before as M*1000+m*100+p."""
    major, rest = divmod(number, 10000 if number >= 20900 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def cudnn_version_string(number):
    """92400 -> "9.24.0". cuDNN 9 encodes its version as M*10000+m*100+p, cuDNN 8 as M*1000+m*100+p."""
    major, rest = divmod(number, 10000 if number >= 90000 else 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def nvidia_driver_version(why_missing):
    """The kernel driver's version; torch does not expose it, the kernel module does."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        why_missing["driver"] = "no NVIDIA driver loaded"
        return None
    match = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", text)
    if match is None:
        why_missing["driver"] = "unrecognised /proc/driver/nvidia/version"
        return None
    return match.group(1)


def rdma_devices():
    """InfiniBand and RoCE devices (mlx5_0 ...), which NCCL prefers to sockets."""
    with contextlib.suppress(OSError):
        return sorted(os.listdir("/sys/class/infiniband"))
    return []


def rdma_ports_inactive(devices=Path("/sys/class/infiniband")):
    """The RDMA ports that are not up ("mlx5_1 port 1 DOWN"). NCCL leaves them out: a host
    with fewer than the others holds the whole job to its bandwidth."""
    inactive = []
    for state_file in sorted(devices.glob("*/ports/*/state")):
        with contextlib.suppress(OSError):
            state = state_file.read_text().split(":")[-1].strip()  # "4: ACTIVE"
            if state != "ACTIVE":
                inactive.append(f"{state_file.parts[-4]} port {state_file.parts[-2]} {state}")
    return inactive


def locked_memory_limit():
    """ulimit -l in bytes, or "unlimited": what RDMA may pin. Over SSH it comes from sshd's
    limits, which need not be the ones a scheduler's jobs get. CAP_IPC_LOCK (root's, say)
    lifts it: "unlimited (CAP_IPC_LOCK)"."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    with contextlib.suppress(OSError, AttributeError):  # (no /proc: macOS)
        status = Path("/proc/self/status").read_text()
        effective = int(re.search(r"^CapEff:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)
        if effective >> CAP_IPC_LOCK & 1:
            return "unlimited (CAP_IPC_LOCK)"
    return "unlimited" if soft == resource.RLIM_INFINITY else soft


def interface_addresses(why_missing):
    """[{"name": "eth0", "address": "10.0.0.5/24"}, ...], IPv4 then IPv6, with the prefix:
    shown in the report, and where GLOO_SOCKET_IFNAME comes from.

    Uses ioctls and /proc rather than `ip addr`, so it needs nothing beyond Python on the host.
    """
    if sys.platform != "linux":  # the ioctls' numbers and /proc are Linux's
        why_missing["interfaces"] = f"listed on Linux only, not on {sys.platform}"
        return None
    try:
        import fcntl

        interfaces = []
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                try:
                    address = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)[20:24]
                    netmask = fcntl.ioctl(sock.fileno(), SIOCGIFNETMASK, request)[20:24]
                except OSError:  # the interface has no IPv4 address
                    continue
                network = ipaddress.IPv4Interface(f"{socket.inet_ntoa(address)}/{socket.inet_ntoa(netmask)}")
                interfaces.append({"name": name, "address": str(network)})
    except OSError as exc:
        why_missing["interfaces"] = f"cannot list interfaces: {describe(exc)}"
        return None
    with contextlib.suppress(OSError):  # no such file: IPv6 is off
        interfaces += ipv6_addresses(Path("/proc/net/if_inet6").read_text())
    return interfaces


def ipv6_addresses(if_inet6):
    """[{"name": "eth0", "address": "fd00::2/64"}, ...] from the lines of /proc/net/if_inet6
    (address, index, prefix length, scope, flags, name), without the link-local ones, which
    a job cannot use."""
    found = []
    for line in if_inet6.splitlines():
        hex_address, _, prefix, scope, _, name = line.split()
        if int(scope, 16) != 0x20:  # link-local
            address = ipaddress.IPv6Address(bytes.fromhex(hex_address))
            found.append({"name": name, "address": f"{address}/{int(prefix, 16)}"})
    return found


def describe(exc):
    return f"{type(exc).__name__}: {exc}"


# --------------------------------------------------------------------------
# Presenting reports: one column per host, one row per field.
# --------------------------------------------------------------------------


def show_gpus(report):
    gpus = report.get("gpus") or []
    return [f"{len(gpus)}"] + [f"{g['name']}, {g['memory_gib']} GiB, cc {g['capability']}"
                               + ("" if g["torch_has_kernels"] else ", no kernels in this torch") for g in gpus]


def show_rdma(report):
    if not report["rdma_devices"]:
        return "none"
    limit = report["locked_memory"]
    inactive = "".join(f"; {port}" for port in report["rdma_ports_inactive"])
    return (f"{', '.join(report['rdma_devices'])}{inactive}; "
            f"memlock {limit if isinstance(limit, str) else size_text(limit)}")


def show_backends(report):
    available = [name for name in ("gloo", "nccl") if report.get(f"{name}_available")]
    return ", ".join(available) if available else None


# (label, key, how to show it, whether a difference between hosts is marked).
# Hostnames and addresses differ by nature, so marking them would be noise.
ROWS = [
    ("hostname", "hostname", None, False),
    ("os", "os", None, True),
    ("python", "python", None, True),
    ("interpreter", "python_executable", None, True),
    ("torch", "torch", None, True),
    ("torchvision", "torchvision", None, True),
    ("CUDA runtime", "cuda_runtime", None, True),
    ("cuDNN", "cudnn", None, True),
    ("NCCL", "nccl", None, True),
    ("backends", "gloo_available", show_backends, True),
    ("GPUs", "gpus", show_gpus, True),
    ("driver", "driver", None, True),
    ("interfaces", "interfaces", lambda r: [f"{i['name']} {i['address']}" for i in r["interfaces"]], False),
    ("RDMA", "rdma_devices", show_rdma, True),
    ("env", "env", lambda r: [f"{k}={v}" for k, v in r["env"].items()] or ["(none set)"], True),
]


def cell(report, key, show):
    """The lines one report shows for one field."""
    if "error" in report:
        return ["-"]
    value = report.get(key)
    if value is not None and show is not None:
        value = show(report)
    if value is None:
        reason = report.get("why_missing", {}).get(key)
        return [f"missing ({reason})" if reason else "missing"]
    return (value if isinstance(value, list) else [str(value)]) or ["(none)"]


def format_report(report):
    width = max(len(label) for label, *_ in ROWS)
    lines = []
    for label, key, show, _ in ROWS:
        values = cell(report, key, show)
        lines.append(f"{label:<{width}}  {values[0]}")
        lines.extend(f"{'':<{width}}  {value}" for value in values[1:])
    return "\n".join(lines)


def format_table(labels, reports):
    """Hosts as columns and fields as rows, where that fits the terminal (or 160 characters
    when the output is not one); else hosts grouped by value in each row. '*' marks a row
    whose values differ."""
    status = [["error: " + r["error"]] if "error" in r else ["ok"] for r in reports]
    rows = [("status", status, False)]
    reachable = [i for i, r in enumerate(reports) if "error" not in r]
    for label, key, show, marked in ROWS:
        cells = [cell(r, key, show) for r in reports]
        rows.append((label, cells, marked and any(cells[i] != cells[reachable[0]] for i in reachable)))
    label_width = 2 + max(len(label) for label, *_ in rows)
    table = host_columns(labels, rows, label_width)
    if max(len(line) for line in table) > shutil.get_terminal_size((160, 24)).columns:
        table = value_groups(labels, rows, label_width, reachable)
    if any(differs for *_, differs in rows):
        table.append("(* = differs between hosts)")
    return "\n".join(table)


def host_columns(labels, rows, label_width):
    widths = [max(len(line) for _, cells, _ in rows for line in cells[i]) for i in range(len(labels))]
    widths = [max(w, len(label)) for w, label in zip(widths, labels)]

    def line(first, columns):
        return "  ".join([f"{first:<{label_width}}"] + [f"{c:<{w}}" for c, w in zip(columns, widths)]).rstrip()

    out = [line("", labels), line("", ["-" * w for w in widths])]
    for label, cells, differs in rows:
        for n in range(max(len(c) for c in cells)):
            first = ("* " if differs else "  ") + label if n == 0 else ""
            out.append(line(first, [c[n] if n < len(c) else "" for c in cells]))
    return out


def value_groups(labels, rows, label_width, reachable):
    """Each row's value once, where the hosts agree; else each value after the hosts that
    have it, the most common one last as 'the other N'. The status row names the hosts
    that failed; the others leave them out."""
    out = [f"{len(labels)} hosts: {', '.join(labels)}", ""]
    for label, cells, differs in rows:
        hosts_by_value = {}
        for i in range(len(labels)) if label == "status" else reachable:
            hosts_by_value.setdefault(tuple(cells[i]) or ("(none)",), []).append(labels[i])
        if not hosts_by_value:  # no host answered: only the status row has values
            continue
        lines = []
        if len(hosts_by_value) == 1:
            lines = list(next(iter(hosts_by_value)))
        else:
            common = max(hosts_by_value, key=lambda value: len(hosts_by_value[value]))
            if len(hosts_by_value[common]) == 1:
                common = None  # every host its own value: name each
            for value, hosts in sorted(hosts_by_value.items(), key=lambda item: item[0] == common):
                who = f"the other {len(hosts)}" if value == common else ", ".join(hosts)
                lines += [f"{who}: {value[0]}"] + [f"  {line}" for line in value[1:]]
        first = ("* " if differs else "  ") + label
        out += [f"{first if n == 0 else '':<{label_width}}  {text}" for n, text in enumerate(lines)]
    return out


# --------------------------------------------------------------------------
# Comparing hosts.
# --------------------------------------------------------------------------


def major_minor(version):
    return ".".join(version.split(".")[:2])


def public_version(version):
    """2.8.0 of 2.8.0+cu128: PyPI's wheel and download.pytorch.org's of one release differ
    only in that label, and the CUDA runtime and NCCL rows tell builds apart. A label that
    names a commit is kept: NGC's containers (2.8.0a0+5228986c39.nv25.06) and source builds
    of one version differ in code."""
    return re.sub(r"\+(cpu|cu\d+|rocm[\d.]+|xpu)$", "", version)


# What must be equal on every host for a job to start: a mismatch here hangs
# init or fails with a cryptic NCCL or unpickling error.
MUST_MATCH = [
    ("python", "python", major_minor),
    ("torch", "torch", public_version),
    ("torchvision", "torchvision", public_version),
    ("CUDA runtime", "cuda_runtime", str),
    ("NCCL", "nccl", str),
]
# Where no host has a GPU, the job runs gloo on the CPU, which a CPU-only build and a CUDA
# build of one release share.
MUST_MATCH_WITH_GPUS = {"cuda_runtime", "nccl"}


# torchrun's rendezvous compares each host's heartbeats, stamped by its own clock, with its
# own clock, and takes a host whose last one looks 15 s old for gone (they come every 5 s):
# hosts whose clocks are this far apart for certain are a problem, as in launch.sh.
CLOCK_SKEW_S = 4
# torchrun before 2.5 sends the workers to rank 0's host name (socket.getfqdn()); later
# ones to its --local-addr (launch.sh) or the rendezvous host (--allreduce). On hosts
# that cannot resolve each other's names, the old way hangs.
MULTI_NODE_TORCH = (2, 5)
# Before 2.8, a gloo rank can hang in destroy_process_group as a job ends (pytorch#154976).
MINIMUM_TORCH = (2, 8)


def torch_older_than(version, minimum):
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return (int(major), int(minor)) < minimum


def find_problems(labels, reports, nproc=None):
    """One line per problem, host by host."""
    usable = [(label, r) for label, r in zip(labels, reports) if "error" not in r and r["torch"] is not None]
    references = reference_hosts(usable)
    uses_gpus = any(r["gpus"] for _, r in usable)
    problems = []
    for label, report in zip(labels, reports):
        if "error" in report:
            problems.append(f"{label}: {report['error']}")
        elif report["torch"] is None:
            why = report["why_missing"]["torch"]
            problems.append(f"{label}: torch {why} (interpreter {report['python_executable']})")
        else:
            if len(reports) > 1 and torch_older_than(report["torch"], MULTI_NODE_TORCH):
                minimum = ".".join(map(str, MULTI_NODE_TORCH))
                problems.append(
                    f"{label}: torch {report['torch']} is older than {minimum}: its torchrun sends "
                    f"workers to rank 0's host name, which every host must then resolve (upgrade torch)"
                )
            elif not uses_gpus and torch_older_than(report["torch"], MINIMUM_TORCH):  # gloo's
                problems.append(
                    f"{label}: torch {report['torch']} is older than {'.'.join(map(str, MINIMUM_TORCH))}: "
                    "a gloo rank can hang in destroy_process_group as the job ends (pytorch#154976; "
                    "upgrade torch)"
                )
            problems += missing_interfaces(label, report)
            if "gpus" in report["why_missing"]:
                problems.append(f"{label}: CUDA cannot use the GPUs: {report['why_missing']['gpus']}")
            else:
                problems += gpu_shortage(label, report, nproc, uses_gpus)
                problems += gpus_without_kernels(label, report)
                problems += gpus_taken(label, report)
            if len(reports) > 1:  # RDMA carries traffic between hosts only
                problems += locked_memory_problem(label, report)
            problems += differences(label, report, references, uses_gpus)
    return problems + clock_problems(usable)


def missing_interfaces(label, report):
    """GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME naming interfaces the host lacks: names
    differ from host to host (eth1, ens5), and gloo then fails at start-up ("Unable to find
    address for: eth1"), NCCL at the first collective."""
    names = sorted({interface["name"] for interface in report.get("interfaces") or []})
    if not names:  # unknown
        return []
    problems = []
    gloo = report["env"].get("GLOO_SOCKET_IFNAME")
    missing = [name for name in (gloo or "").split(",") if name and name not in names]
    if missing:
        problems.append(f"{label}: GLOO_SOCKET_IFNAME={gloo}, but it has no interface {', '.join(missing)} "
                        f"(only {', '.join(names)})")
    # NCCL's syntax: a comma-separated list of name prefixes, "=" first for exact names, and
    # "^" first for names to avoid (which this leaves alone); each may end in ":PORT".
    nccl = report["env"].get("NCCL_SOCKET_IFNAME", "")
    if nccl and not nccl.startswith("^"):
        names_or_prefixes = (item.split(":")[0] for item in nccl.removeprefix("=").split(","))
        wanted = [w for w in names_or_prefixes if w]  # an empty item matches nothing
        matches = (name == w if nccl.startswith("=") else name.startswith(w) for name in names for w in wanted)
        if not any(matches):
            problems.append(f"{label}: NCCL_SOCKET_IFNAME={nccl} matches none of its interfaces ({', '.join(names)})")
    return problems


def gpu_shortage(label, report, nproc, uses_gpus):
    """With GPUs in the job, every host needs one per process; without, any --nproc runs on CPU."""
    count = len(report["gpus"])
    if not uses_gpus or count >= (nproc or 1):
        return []
    if nproc is None:
        return [f"{label}: no GPU visible, but other hosts have GPUs (nccl and gloo do not mix)"]
    return [f"{label}: --nproc {nproc} but only {count} GPU(s) visible"]


def gpus_taken(label, report):
    """GPUs where a context cannot start, or whose memory other processes mostly hold: a
    job's, maybe one that outlived its job. (A context takes about 0.5 GiB itself.)"""
    problems = []
    for i, gpu in enumerate(report["gpus"]):
        if "error" in gpu:
            problems.append(f"{label}: GPU {i} ({gpu['name']}) cannot be used: {gpu['error']}")
        elif gpu["free_gib"] < gpu["memory_gib"] / 2:
            problems.append(f"{label}: GPU {i} ({gpu['name']}) has {gpu['free_gib']} GiB free of {gpu['memory_gib']}: "
                            "other processes hold the rest (a job's, or one left from an earlier job? nvidia-smi)")
    return problems


def gpus_without_kernels(label, report):
    """GPUs newer (or older) than any this torch was built for: every kernel fails there."""
    missing = sorted({f"{g['name']} (cc {g['capability']})" for g in report["gpus"] if not g["torch_has_kernels"]})
    if not missing:
        return []
    return [f"{label}: torch {report['torch']} has no kernels for its {', '.join(missing)}: CUDA calls "
            "fail there (\"no kernel image is available\"); install a torch built for it"]


def locked_memory_problem(label, report):
    """RDMA pins the memory it sends from, up to ulimit -l: NCCL over InfiniBand or RoCE
    needs it unlimited, as the RDMA stacks' own guides set it."""
    limit = report["locked_memory"]
    uses_rdma = report["gpus"] and report["rdma_devices"] and report["env"].get("NCCL_IB_DISABLE") != "1"
    if not uses_rdma or isinstance(limit, str):  # unlimited
        return []
    return [f"{label}: ulimit -l is {size_text(limit)} where RDMA ({', '.join(report['rdma_devices'])}) "
            "needs pinned memory: NCCL over InfiniBand can fail to register its buffers; set memlock "
            "unlimited in /etc/security/limits.d/ (or NCCL_IB_DISABLE=1 for sockets)"]


def reference_hosts(usable):
    """For each value of MUST_MATCH, the (label, report) of the first of the usable hosts
    whose value is the most common one (the first host's, where values tie): one odd host,
    the first one included, is named alone, not every host that differs from it."""
    references = {}
    for _, key, comparable in MUST_MATCH:
        values = [comparable(shown_value(report[key])) for _, report in usable]
        counts = Counter(values)
        most = max(counts.values(), default=0)
        references[key] = next((host for host, value in zip(usable, values) if counts[value] == most), None)
    return references


def shown_value(value):
    return "missing" if value is None else value


def differences(label, report, references, uses_gpus):
    """How report differs from the references in what must match."""
    found = []
    for name, key, comparable in MUST_MATCH:
        if key in MUST_MATCH_WITH_GPUS and not uses_gpus:
            continue
        ref_label, ref = references[key]
        mine, theirs = shown_value(report[key]), shown_value(ref[key])
        if comparable(mine) != comparable(theirs):
            why = report["why_missing"].get(key) if report[key] is None else None
            shown = f"missing ({why})" if why else mine  # torchvision that fails to import, say
            found.append(f"{label}: {name} {shown} differs from {ref_label} ({theirs})")
    return found


def clock_problems(usable):
    """Each host whose clock is CLOCK_SKEW_S from the reference's or more for certain, or,
    where none is, the one most ahead, if it is that far from the one most behind. The
    reference is the host whose clock agrees with the most others' (the first, where they
    tie), so that one odd clock, the first host's included, is named alone. Each
    (label, report) of usable holds the range of its clock's offset from this machine's."""
    offsets = {label: report["clock_offset"] for label, report in usable}
    labels = list(offsets)

    def apart(a, b):
        return max(offsets[a][0] - offsets[b][1], offsets[b][0] - offsets[a][1]) >= CLOCK_SKEW_S

    def problem(a, b):
        difference = (sum(offsets[a]) - sum(offsets[b])) / 2
        return (f"{a}: its clock is about {abs(difference):.0f} s {'ahead of' if difference > 0 else 'behind'} "
                f"{b}'s, and torchrun's rendezvous, which compares the hosts' clocks, drops a host at 15 s off "
                "or less: sync them (NTP: chrony, systemd-timesyncd)")

    reference = max(labels, key=lambda a: sum(not apart(a, b) for b in labels), default=None)
    found = [problem(label, reference) for label in labels if apart(label, reference)]
    if labels and not found:
        ahead = max(labels, key=lambda label: offsets[label][0])
        behind = min(labels, key=lambda label: offsets[label][1])
        if apart(ahead, behind):
            found = [problem(ahead, behind)]
    return found


def holds_address(address):
    """Whether this machine holds address (IPv4 or IPv6, on any interface); True when
    it cannot tell."""
    address = address.removeprefix("::ffff:")
    try:
        with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as probe:
            probe.bind((address, 0))
    except OSError as exc:
        return exc.errno != errno.EADDRNOTAVAIL
    return True


def job_addresses(hosts, reports):
    """(each host's address for the job, one line per problem), as launch.sh picks them.

    A remote host's address is the one SSH reached it at: the other hosts reach it
    there as this machine did, on a shared subnet or a routed network (a /32 per host)
    alike. This machine's is the address the first remote host saw it connect from
    (which it must hold: not so behind NAT or a jump host), or 127.0.0.1 when every
    host is this machine. An unreachable host has None.
    """
    addresses, problems, seen = [], [], {}  # seen: address -> the first host reached there
    client = None  # this machine, as the first remote host saw it
    for host, report in zip(hosts, reports):
        fields = (report.get("ssh_connection") or "").split()
        address = fields[2] if len(fields) == 4 else None
        addresses.append(address)
        if host.is_local or "error" in report:
            continue
        if address is None:
            problems.append(f"{host.entry}: its sshd sets no SSH_CONNECTION, so its address is unknown")
        elif (address.startswith("127.") or address == "::1") and len(hosts) > 1:  # unreachable by the others
            problems.append(
                f"{host.entry}: reached at {address} (a tunnel?): list it by an address the other hosts can reach"
            )
        elif address in seen:
            problems.append(
                f"{host.entry}: reached at {address}, as {seen[address]} is (one machine under two names? "
                "containers behind one address?): every host needs its own address"
            )
        else:
            seen[address] = host.entry
        client = client or (fields[0] if address else None)
    if client and not holds_address(client):
        problems += [
            f"{host.entry}: the other hosts see this machine as {client}, which it does not hold "
            "(NAT or a jump host?): they cannot reach it there"
            for host, report in zip(hosts, reports)
            if host.is_local and "error" not in report
        ]
    this_machine = client or "127.0.0.1"
    return [this_machine if host.is_local else address for host, address in zip(hosts, addresses)], problems


# --------------------------------------------------------------------------
# hosts.txt and running commands on hosts.
# --------------------------------------------------------------------------

# [user@]host[:port], the same rule as launch.sh's. Nothing may start with "-"
# (ssh would read an option) and no shell metacharacter can pass: a hosts file
# must never be able to run a command.
HOST_RE = re.compile(
    r"(?:(?P<user>[A-Za-z0-9_][A-Za-z0-9._-]*)@)?(?P<name>[A-Za-z0-9_][A-Za-z0-9._-]*)(?::(?P<port>[0-9]{1,5}))?"
)


class UsageError(Exception):
    """A mistake in the command line or hosts file: one line, exit 2."""


@dataclass(frozen=True)
class Host:
    entry: str  # as written in hosts.txt, used as the label
    user: str | None
    name: str
    port: str | None
    is_local: bool

    @property
    def target(self):
        return f"{self.user}@{self.name}" if self.user else self.name


def read_hosts(path):
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # -sig: a byte-order mark is no part of line 1
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read hosts file {path}: {exc}") from None
    local_names = this_machine_names()
    hosts, seen = [], {}
    for number, raw in enumerate(text.splitlines(), 1):
        entry = raw.split("#", 1)[0].strip()
        if not entry:
            continue
        match = HOST_RE.fullmatch(entry)
        if match is None or (match["port"] and not 0 < int(match["port"]) < 65536):
            hint = ""
            if re.search(r"\sslots=", entry):
                hint = " (DeepSpeed's and MPI's slots=N has no place here: --nproc applies to every host)"
            raise UsageError(f"{path}:{number}: invalid host {entry!r}; expected [user@]host[:port]{hint}")
        # A user or port says "go through ssh", e.g. to a container's sshd on this machine.
        name = match["name"].lower()  # hostnames ignore case
        is_local = (name in local_names or name.startswith("127.")) and not match["user"] and not match["port"]
        key = "this machine" if is_local else (name, match["port"] or "22")  # under any of its names
        if key in seen:
            this_machine = "this machine, " if is_local else ""
            raise UsageError(f"{path}:{number}: duplicate host {entry!r} ({this_machine}also on line {seen[key]})")
        seen[key] = number
        hosts.append(Host(entry, match["user"], match["name"], match["port"], is_local))
    if not hosts:
        raise UsageError(f"{path}: no hosts listed")
    return hosts


def this_machine_names():
    node_name = socket.gethostname().lower()
    names = {"localhost", node_name, node_name.split(".")[0], socket.getfqdn().lower()}
    names.update(i["address"].split("/")[0] for i in interface_addresses({}) or [])
    return names


# Runs first on a remote host, by --python: reads the forwarded variables, a line of JSON,
# from stdin, then becomes the command (its arguments) with them set. So no value is on a
# command line, where `ps` would show it, or where a login shell would parse it (tcsh
# expands "!" even in single quotes). It reads byte by byte, leaving the rest of stdin to
# the command.
FORWARD_ENV = """\
import json, os, sys
line = b""
while not line.endswith(b"\\n"):
    byte = os.read(0, 1)
    if not byte:
        break
    line += byte
os.execvpe(sys.argv[1], sys.argv[1:], dict(os.environ, **json.loads(line.decode())))
"""
# As one line of base64 characters: tcsh and fish take no newline within quotes.
FORWARD_ENV_CODE = f'import base64; exec(base64.b64decode("{base64.b64encode(FORWARD_ENV.encode()).decode()}"))'


def host_command(host, argv, python):
    """The command line that runs argv on host: argv itself here, otherwise SSH_COMMAND with
    python running FORWARD_ENV, which takes the line of forwarded_input first."""
    if host.is_local:
        return argv
    ssh = os.environ.get("SSH_COMMAND", "").split() or ["ssh"]  # unset or empty: ssh
    # -T: no terminal, even where ~/.ssh/config forces one: the report streams through
    # stdin, and a node stops when stdin ends, which a terminal never says.
    # RemoteCommand=none: ssh refuses a command given beside one of the config's (tmux, say).
    # ClearAllForwardings: a port forwarded there may be taken by the user's own session.
    # LogLevel=INFO: ssh says why it failed even where the config says QUIET; a Slurm node's
    # refusal comes as a banner, which ssh shows only at INFO or above.
    options = ["-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
               "-o", "RemoteCommand=none", "-o", "ClearAllForwardings=yes", "-o", "LogLevel=INFO"]
    if host.port:
        options += ["-p", host.port]
    return [*ssh, *options, "--", host.target, "exec " + shlex.join([python, "-c", FORWARD_ENV_CODE, *argv])]


def forwarded_input(host):
    """What host_command's stdin starts with: a JSON line of the variables a remote host
    gets from this environment (a local one inherits them)."""
    if host.is_local:
        return b""
    return json.dumps({k: v for k, v in os.environ.items() if FORWARDED.fullmatch(k)}).encode() + b"\n"


# The commands run_on_host has under way, each in a session of its own: a SIGTERM or
# SIGINT kills their groups, or the program would wait for each (the threads that run
# them finish before it ends), up to REPORT_TIMEOUT_S. STOPPING, set then, keeps the
# threads from starting more.
RUNNING = set()
STOPPING = threading.Event()


def start_on_host(host, argv, python, stderr, stdin=subprocess.PIPE):
    """A Popen of argv on host, in a session of its own. Its stdin is a pipe that has been
    given forwarded_input, or `stdin`, a file that begins with it."""
    proc = subprocess.Popen(
        host_command(host, argv, python),
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=stderr,
        start_new_session=True,
    )
    if stdin == subprocess.PIPE:
        with contextlib.suppress(BrokenPipeError):  # an ssh gone at once: its status says why
            proc.stdin.write(forwarded_input(host))
            proc.stdin.flush()
    return proc


def run_on_host(host, argv, python, stdin=b"", timeout=REPORT_TIMEOUT_S):
    """(exit status, stdout, error text); the status is None when it could not run at all."""
    if STOPPING.is_set():
        return None, "", "stopped"
    # Its input comes from a file: communicate() can wait in slices (see
    # communicate_until_stopped) only where it sends no input (CPython gh-141473).
    with tempfile.TemporaryFile() as input_file:
        input_file.write(forwarded_input(host) + stdin)
        input_file.seek(0)
        try:
            proc = start_on_host(host, argv, python, stderr=subprocess.PIPE, stdin=input_file)
        except FileNotFoundError as exc:
            return None, "", f"cannot run {exc.filename}: not found"
        except OSError as exc:  # too many open files, say
            return None, "", f"cannot start its command: {exc.strerror}"
    RUNNING.add(proc)
    try:  # (a signal as it started, which stop_at_signal missed, ends it there)
        stdout, stderr = communicate_until_stopped(proc, timeout)
    finally:
        RUNNING.discard(proc)
    if stdout is None:
        return None, "", "stopped" if STOPPING.is_set() else f"no answer within {timeout} s"
    return proc.returncode, stdout.decode(errors="replace"), stderr.decode(errors="replace")


def communicate_until_stopped(proc, timeout):
    """proc.communicate(), or (None, None) if that takes over `timeout` seconds or STOPPING
    is set first. Then proc's group is killed, and its output is left unread: an ssh that
    shares a ControlMaster's connection hands its pipes to the master, which holds them
    open until the remote command ends (on a hung mount, never)."""
    deadline = time.monotonic() + timeout
    while not STOPPING.is_set() and time.monotonic() < deadline:
        with contextlib.suppress(subprocess.TimeoutExpired):  # a retry loses no output
            return proc.communicate(timeout=min(1, max(0, deadline - time.monotonic())))
    kill_group(proc, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    return None, None


def stop_at_signal(signum, frame):
    """SIGTERM or SIGINT: kill what run_on_host runs, and unwind, so that run_nodes stops
    every node it started."""
    STOPPING.set()
    for proc in list(RUNNING):
        kill_group(proc, signal.SIGKILL)
    sys.exit(128 + signum)


def ssh_refusal_fix(reason, stderr):
    """What fixes ssh's refusal to log in, as launch.sh's preflight says it; else None."""
    if "Permission denied (" in reason:
        return "setup_ssh.sh installs your key; one with a passphrase needs ssh-add first"
    if reason.startswith("Access denied") and "active jobs" in reason:  # Slurm's pam_slurm_adopt
        return "Slurm lets in only users with a job there: run check_env.py in an allocation of these hosts"
    if "Too many authentication failures" in reason:  # sshd's MaxAuthTries, 6 by default
        return ("ssh offers other keys first, ssh-agent's say, more than the host takes: give these hosts "
                "'IdentityFile KEY' and 'IdentitiesOnly yes' in ~/.ssh/config")
    if reason != "Host key verification failed.":
        return None
    if "REMOTE HOST IDENTIFICATION HAS CHANGED" not in stderr:
        return "setup_ssh.sh records a new host's key"
    # ssh's own command names the known_hosts entry as ~/.ssh/config makes it
    removal = re.search(r"^\s*(ssh-keygen .*)$", stderr, re.M)
    return ("its key changed since it was recorded: find out why, then "
            + (removal[1] if removal else "remove the old key from known_hosts"))


def failure(host, python, status, stderr):
    """Why a command on host failed, in the words a user needs to fix it."""
    lines = stderr.strip().splitlines() or [""]
    # The last line, but a PAM module's refusal or sshd's reason for cutting ssh off, which
    # come before ssh's "Connection closed" or "Disconnected from".
    reason = next((line for line in lines if line.startswith(("Access denied", "Received disconnect from "))),
                  lines[-1])
    if status is None:
        return reason
    if status == 255 and not host.is_local:  # ssh's own failure, not the command's
        fix = ssh_refusal_fix(reason, stderr)
        return f"ssh refused the login: {reason} ({fix})" if fix else f"unreachable: {reason or 'ssh said nothing'}"
    if status == 127:
        return f"{python} not found (use --python)"
    return f"{python} failed with exit status {status}: {reason}"


def fetch_report(host, python):
    """host's report, gathered by streaming this file to python there, with the range of its
    clock's offset from this machine's."""
    asked = time.time()
    status, stdout, stderr = run_on_host(host, [python, "-", "--json"], python, stdin=Path(__file__).read_bytes())
    answered = time.time()
    # The last JSON line: a login script may have printed something before it.
    json_lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if status != 0 or not json_lines:
        return {"error": failure(host, python, status, stderr)}
    report = json.loads(json_lines[-1])
    # Its clock began the report after `asked` here, and ended it before `answered`.
    report["clock_offset"] = [report["clock"][1] - answered, report["clock"][0] - asked]
    return report


def fetch_reports(hosts, python):
    remote = [host for host in hosts if not host.is_local]
    if len(remote) > 1:
        # A login to the first remote host alone first, as launch.sh's preflight does: a
        # ControlMaster it opens (to a bastion, say) then serves the others. All at once, each
        # would open a connection of its own, and past 10 a bastion's sshd drops some
        # (MaxStartups). Whatever fails here, that host's report says.
        run_on_host(remote[0], ["true"], python, timeout=FIRST_ALONE_S)
    return on_every_host(hosts, lambda host: fetch_report(host, python))


def allow_open_files(count):
    """Raises this process's limit on open files to count, where the hard limit allows: the
    common soft limit of 1024 (256 on macOS) would fail hundreds of hosts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count:
        wanted = count if hard == resource.RLIM_INFINITY else min(count, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def on_every_host(hosts, function):
    """[function(host) for host in hosts], run in parallel: one slow host must not add up.
    A host still at it after PATIENCE_S is named, so that a wait of up to REPORT_TIMEOUT_S
    does not look like a hang."""
    with ThreadPoolExecutor(max_workers=len(hosts)) as pool:  # every host's wait starts now
        futures = [pool.submit(function, host) for host in hosts]
        _, pending = wait(futures, timeout=PATIENCE_S)
        if pending:
            late = ", ".join(host.entry for host, future in zip(hosts, futures) if future in pending)
            print(f"check_env.py: still waiting for {late} after {PATIENCE_S} s (giving up at "
                  f"{REPORT_TIMEOUT_S} s)", file=sys.stderr, flush=True)
        return [future.result() for future in futures]


# --------------------------------------------------------------------------
# All-reduce benchmark: torchrun on every host, each joining a c10d rendezvous
# on the first host. Started here rather than through launch.sh because the
# reports already give each node the address to use (job_addresses), and
# every timeout below must be set for the run to end in seconds.
# --------------------------------------------------------------------------


def allreduce_worker():
    """The benchmark body, run by torchrun on every rank (--allreduce-worker)."""
    threading.Thread(target=exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        device_id=device if backend == "nccl" else None,  # binds NCCL to this rank's GPU
    )
    rows = []
    for size in ALLREDUCE_SIZES_NCCL if backend == "nccl" else ALLREDUCE_SIZES:
        # A link that takes this long is at its peak by 64 MiB, and 1 GiB over it would
        # take longer than the run may (the time is the slowest rank's: all stop alike).
        if size > ALLREDUCE_SIZES[-1] and rows[-1]["seconds"] > ALLREDUCE_SLOW_S:
            break
        rows.append(time_allreduce(size, device, rank, world))
    if rank == 0:
        result = {"backend": backend, "world_size": world, "rows": rows}
        print(RESULT_MARKER + json.dumps(result), flush=True)


def exit_when_orphaned(torchrun_pid):
    """End this worker once torchrun, its parent, is gone (killed by run_node, say):
    blocked in a collective, it would otherwise wait for COLLECTIVE_TIMEOUT_S."""
    while os.getppid() == torchrun_pid:
        time.sleep(0.5)
    os._exit(1)


def time_allreduce(size, device, rank, world):
    import torch
    import torch.distributed as dist

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    x = torch.empty(size // 4, dtype=torch.float32, device=device)
    # The first warm-up checks the sum, like nccl-tests' #wrong column.
    x.fill_(rank + 1)
    dist.all_reduce(x)
    correct = (x == world * (world + 1) / 2).all().to(torch.int32)
    dist.all_reduce(correct, op=dist.ReduceOp.MIN)  # right on every rank, not only rank 0
    x.zero_()  # zeros stay zeros: no overflow to inf while timing
    for _ in range(ALLREDUCE_WARMUPS - 1):
        dist.all_reduce(x)
    iterations = max(3, min(20, ALLREDUCE_BYTES_PER_SIZE // size))
    synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(x)
    synchronize()
    # The slowest rank's time is the collective's time.
    seconds = torch.tensor([(time.perf_counter() - start) / iterations], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return {"bytes": size, "seconds": seconds.item(), "correct": bool(correct)}


def format_allreduce(result, nodes):
    world = result["world_size"]
    lines = [
        f"all-reduce, float32 sum, {result['backend']}, {nodes} node(s), {world} ranks",
        f"{'size':>9} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}  check",
    ]
    busbws = []
    for row in result["rows"]:
        algbw = row["bytes"] / row["seconds"] / 1e9
        busbw = algbw * 2 * (world - 1) / world  # what each link carries in a ring all-reduce
        busbws.append(busbw)
        check = "ok" if row["correct"] else "WRONG SUM"
        size = size_text(row["bytes"])
        lines.append(f"{size:>9} {row['seconds'] * 1e6:>10.1f} {algbw:>12.4g} {busbw:>12.4g}  {check}")
    # The largest size is the bandwidth; the small ones time the latency.
    lines.append(f"busbw at {size_text(result['rows'][-1]['bytes'])}: {busbws[-1]:.4g} GB/s (averaged over every "
                 f"size, as nccl-tests' \"Avg bus bandwidth\": {sum(busbws) / len(busbws):.4g} GB/s)")
    return "\n".join(lines)


def size_text(nbytes):
    return f"{nbytes // 1024} KiB" if nbytes < 2**20 else f"{nbytes // 2**20} MiB"


def gloo_interface(report, address):
    """["env", "GLOO_SOCKET_IFNAME=<the interface holding address>"], or [] when unknown or
    already set there (report["env"] holds the host's own and the forwarded variables).
    Otherwise gloo binds to the address the host's name resolves to, which Debian and
    Ubuntu map to 127.0.1.1, where no other host can connect (launch.sh does the same)."""
    if "GLOO_SOCKET_IFNAME" in report["env"]:
        return []
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:  # None: unknown
        return []
    wanted = getattr(wanted, "ipv4_mapped", None) or wanted  # ::ffff:10.0.0.1 is 10.0.0.1
    for interface in report.get("interfaces") or []:
        if ipaddress.ip_interface(interface["address"]).ip == wanted:
            return ["env", f"GLOO_SOCKET_IFNAME={interface['name']}"]
    return []


FREE_PORT = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


def run_allreduce(hosts, reports, addresses, python, nproc):
    """Run the benchmark on every host, each node at its address from job_addresses;
    (exit status, text to print)."""
    script = os.path.abspath(__file__)
    found = on_every_host(hosts, lambda host: run_on_host(host, ["test", "-f", script], python)[0] == 0)
    missing = [host.entry for host, there in zip(hosts, found) if not there]
    if missing:
        return 1, (
            f"--allreduce runs {script} through torchrun on every host, so it must be at that path "
            f"on every host (a shared filesystem or the same image); it is not on: {', '.join(missing)}"
        )
    status, stdout, stderr = run_on_host(hosts[0], [python, "-c", FREE_PORT], python)
    ports = re.findall(r"^\d+$", stdout, re.M)  # after a login script's banner, if any
    if status != 0 or not ports:
        return 1, f"{hosts[0].entry}: cannot pick a rendezvous port: {failure(hosts[0], python, status, stderr)}"
    master = f"[{addresses[0]}]" if ":" in addresses[0] else addresses[0]  # IPv6
    endpoint = f"{master}:{ports[-1]}"
    run_id = secrets.token_hex(4)
    commands = [
        [
            *gloo_interface(report, addr),
            python, script, "--run-node",  # which stops this node when this script is gone
            python, "-m", "torch.distributed.run",
            f"--nnodes={len(hosts)}", f"--nproc-per-node={nproc}", "--max-restarts=0",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id=check-env-{run_id}",
            # is_host: the first node serves the store. torchrun would guess it
            # from name lookups, which fail where hosts cannot resolve each other.
            f"--rdzv-conf=read_timeout={RDZV_READ_TIMEOUT_S},join_timeout={RDZV_JOIN_TIMEOUT_S},"
            f"is_host={str(node == 0).lower()}",
            f"--local-addr={addr}", script, "--allreduce-worker",
        ]
        for node, (addr, report) in enumerate(zip(addresses, reports))
    ]  # fmt: skip
    outputs, failed, hung = run_nodes(hosts, commands, python)
    if hung:
        ends = "\n".join(f"{host.entry}:\n{tail(output, 5)}" for host, output in zip(hosts, outputs))
        return 1, (
            f"not every node finished within {ALLREDUCE_DEADLINE_S} s, start-up included: a hang, e.g. NCCL "
            "connecting over an interface the others cannot reach (set NCCL_SOCKET_IFNAME; NCCL_DEBUG=INFO "
            "shows its choice), or a node that is that slow to import torch (a network filesystem?). "
            f"The end of each node's output:\n{ends}"
        )
    if failed is not None:
        return 1, explain_node_failure(hosts, failed, outputs, endpoint)
    for output in outputs:
        for line in output.splitlines():
            if line.startswith(RESULT_MARKER):
                return 0, format_allreduce(json.loads(line[len(RESULT_MARKER) :]), len(hosts))
    return 1, "all-reduce finished without a result; output of the first host:\n" + tail(outputs[0])


def run_nodes(hosts, commands, python):
    """Start every node (each a --run-node command), wait for all; stop them all as
    soon as one fails.

    Returns (each node's output, index of the first node that failed or None,
    whether the deadline came first).
    """
    procs = []
    with ThreadPoolExecutor(max_workers=len(hosts)) as readers:
        try:
            for host, argv in zip(hosts, commands):
                # stdin stays open: its end stops the node, whether stop() closes
                # it or this script is killed. Its own session: Ctrl-C reaches
                # this script only, which stops the nodes in order.
                procs.append(start_on_host(host, argv, python, stderr=subprocess.STDOUT))
            outputs = [readers.submit(read_all, proc.stdout) for proc in procs]
            failed, hung = wait_for_nodes(procs, time.monotonic() + ALLREDUCE_DEADLINE_S)
        finally:
            stop(procs)
        return [output.result() for output in outputs], failed, hung


def read_all(stream):
    return stream.read().decode(errors="replace")


def wait_for_nodes(procs, deadline):
    """(index of the first node to fail or None, whether the deadline came first)."""
    while True:
        statuses = [proc.poll() for proc in procs]
        failed = [i for i, status in enumerate(statuses) if status not in (None, 0)]
        if failed:
            return failed[0], False
        if None not in statuses:
            return None, False
        if time.monotonic() > deadline:
            return None, True
        time.sleep(0.1)


def stop(procs):
    """Close each node's stdin, so that it stops its torchrun, and wait for the nodes to
    end; SIGKILL the process groups, here, of those that have not after NODE_STOP_S."""
    for proc in procs:
        with contextlib.suppress(BrokenPipeError):  # what start_on_host wrote to an ssh gone at once
            proc.stdin.close()
    deadline = time.monotonic() + NODE_STOP_S
    for proc in procs:
        wait_or_kill_group(proc, max(0, deadline - time.monotonic()))


def wait_or_kill_group(proc, timeout):
    """Wait up to timeout seconds for proc to end, then SIGKILL its process group."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc, signal.SIGKILL)
        proc.wait()


def kill_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:  # it has just exited
        pass


def run_node(argv):
    """--run-node: run argv (torchrun) until it ends or stdin closes, which happens when
    run_nodes stops the node or is gone, killed even; then stop argv, as on a SIGTERM,
    SIGHUP or SIGINT. Its status is the node's. (Not SIGHUP from a terminal, through
    `ssh -tt`: that missed a node now and then, and never came when this script was
    killed, as its ssh clients live on.)"""
    stopping = threading.Event()  # set before torchrun starts even, it stops torchrun at once
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(signum, lambda *_: stopping.set())
    threading.Thread(target=set_at_end_of_stdin, args=(stopping,), daemon=True).start()
    # stderr into stdout here: ssh carries stderr apart, and lines of the two would
    # arrive cut and out of order.
    torchrun = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    threading.Thread(target=stop_torchrun_once_set, args=(stopping, torchrun), daemon=True).start()
    status = torchrun.wait()
    return 128 - status if status < 0 else status  # as a shell tells a signal


def set_at_end_of_stdin(event):
    while os.read(0, 4096):  # not sys.stdin, whose lock this daemon thread would hold at exit
        pass
    event.set()


def stop_torchrun_once_set(event, torchrun):
    """SIGTERM torchrun's group once event is set; SIGKILL it after TORCHRUN_STOP_S.
    torchrun passes SIGTERM on to its workers, in sessions of their own; they end by
    themselves if it is killed (exit_when_orphaned)."""
    event.wait()
    kill_group(torchrun, signal.SIGTERM)
    wait_or_kill_group(torchrun, TORCHRUN_STOP_S)


def explain_node_failure(hosts, failed, outputs, endpoint):
    output = outputs[failed]
    if "RendezvousConnectionError" in output:
        why = f"cannot reach the rendezvous at {endpoint} (a firewall, or the wrong address?)"
    elif "RendezvousTimeoutError" in output:
        why = f"not every node joined the rendezvous at {endpoint} within {RDZV_JOIN_TIMEOUT_S} s"
    else:
        why = "the all-reduce failed"
    # The exception lines say what happened; torchrun's tracebacks around them do not. A
    # worker killed by a signal raises nothing: torchrun's report says which signal.
    # Once its process group exists, torch prefixes a rank's traceback lines with "[rankN]: ".
    # NCCL gives its cause on the line after "Last error:".
    text = re.sub(r"^\[rank\d+\]: ", "", output, flags=re.M).replace("Last error:\n", "Last error: ")
    said = [line.strip() for line in text.splitlines()
            if re.match(r"[\w.]+(Error|Exception): \S|Last error: \S|\s+exitcode +: |\s+traceback +: Signal", line)]
    details = "\n".join(said[-4:]) or tail(output)
    return f"{hosts[failed].entry}: {why}\n{details}"


def tail(text, lines=15):
    return "\n".join(text.strip().splitlines()[-lines:])


# --------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--json", action="store_true", help="print reports (and problems, with --hosts) as JSON")
    parser.add_argument("--hosts", metavar="FILE", help="compare every host listed in FILE")
    parser.add_argument(
        "--nproc", type=positive_int, metavar="N", help="processes per host: with GPUs, each host needs N of them"
    )
    parser.add_argument(
        "--python",
        metavar="PATH",
        default=sys.executable,
        help="interpreter to run on every host, looked up on the remote PATH if not absolute (default: %(default)s)",
    )
    parser.add_argument(
        "--allreduce",
        action="store_true",
        help="after the comparison, time all-reduce across all hosts (1 KiB..64 MiB, on nccl to 1 GiB); "
        "without --hosts, between this machine's processes (its GPUs, say)",
    )
    # Internal: what runs torchrun on each host, and what torchrun runs on each rank, for --allreduce.
    parser.add_argument("--run-node", nargs=argparse.REMAINDER, metavar="ARGV", help=argparse.SUPPRESS)
    parser.add_argument("--allreduce-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.allreduce and args.json:
        parser.error("--allreduce prints a table; it cannot be combined with --json")
    return args


def positive_int(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return int(text)


def check_hosts(args):
    hosts = read_hosts(args.hosts) if args.hosts else [Host("localhost", None, "localhost", None, True)]
    allow_open_files(3 * len(hosts) + 64)  # every host's command holds 3 here, all at once
    reports = fetch_reports(hosts, args.python)
    labels = [host.entry for host in hosts]
    addresses, address_problems = job_addresses(hosts, reports)
    problems = find_problems(labels, reports, args.nproc) + address_problems
    # For --allreduce: one process per GPU, or 1 on CPU. Refused before any table is printed.
    nproc = args.nproc or max(1, min(len(r.get("gpus") or []) for r in reports))
    if args.allreduce and not problems and len(hosts) * nproc < 2:
        raise UsageError(f"--allreduce needs 2 processes or more, and this is {len(hosts)} host x {nproc} "
                         "process: add hosts, or --nproc 2")
    if args.json:
        print(json.dumps({"hosts": dict(zip(labels, reports)), "problems": problems}, indent=2))
        return 1 if problems else 0
    print(format_table(labels, reports))
    print()
    if problems:
        print(f"{len(problems)} problem(s):")
        print("\n".join(problems))
        if args.allreduce:
            print("all-reduce skipped: fix the problems above first")
        return 1
    print(f"OK: all {len(hosts)} host(s) match on python, torch, torchvision, CUDA runtime and NCCL")
    if not args.allreduce:
        return 0
    print(f"\nall-reduce: starting torchrun on {len(hosts)} host(s) x {nproc} process(es)...", flush=True)
    status, text = run_allreduce(hosts, reports, addresses, args.python, nproc)
    print(text)
    return status


def main(argv=None):
    args = parse_args(argv)
    if args.run_node:
        return run_node(args.run_node)
    if args.allreduce_worker:
        allreduce_worker()
        # Done. Exit without destroying the process group or running the interpreter's C++
        # teardown: with gloo, torch before 2.8 can deadlock in the group's destructor
        # (pytorch#154976; 6 runs in 27 here with 2.5.1, under load), and 2.14 aborts in
        # the teardown now and then ("terminate called without an active exception").
        # Either would fail a benchmark that has finished.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if not (args.hosts or args.allreduce or args.nproc):
        report = gather_report()
        print(json.dumps(report) if args.json else format_report(report))
        return 0
    signal.signal(signal.SIGTERM, stop_at_signal)
    signal.signal(signal.SIGINT, stop_at_signal)
    try:
        return check_hosts(args)
    except UsageError as exc:
        print(f"check_env.py: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        status = main()
        sys.stdout.flush()  # here, not at exit: a report shorter than the buffer is written now
    except BrokenPipeError:  # `| head` has read what it wanted: stop quietly, as cat does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # else Python's flush at exit raises it again
        sys.exit(1)
    sys.exit(status)
