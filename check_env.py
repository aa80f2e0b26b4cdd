#!/usr/bin/env python3
"""Check that hosts can run a multi-node PyTorch job together, before you launch one.

examples:
  python check_env.py                              this machine's report (--json: as JSON)
  python check_env.py --hosts hosts.txt --nproc 4  compare the hosts (with GPUs: 4 each)
  python check_env.py --slurm                      compare the nodes of this SLURM allocation
  python check_env.py --allreduce --nproc 2        time all-reduce between 2 processes here
  python check_env.py --hosts hosts.txt --allreduce
                                                   ... and across the hosts, through launch.sh

--hosts reaches each host with SSH_COMMAND (default: ssh) and streams this file to its
Python, so nothing needs installing there; --slurm runs it on every node through srun.
--allreduce needs check_env.py at the same path on every host. docs/check_env.md says
what each row and problem means. Exit status: 0 when the hosts match, 1 when a problem
was found (one line each), 2 for a usage error.
"""

import sys

if sys.version_info < (3, 10):  # one line, where --python finds an old interpreter
    sys.exit(f"check_env.py needs Python 3.10 or newer, not {'.'.join(map(str, sys.version_info[:3]))}")

import argparse
import contextlib
import fcntl
import ipaddress
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections import Counter, namedtuple
from datetime import timedelta
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPORT_TIMEOUT_S = 90  # a cold `import torch` on a network filesystem can be slow
PATIENCE_S = 10  # then the hosts still being waited for are named
# torchrun's rendezvous drops a host whose heartbeats, stamped by its own clock, look 15 s old
# to another: clocks this far apart for certain are a problem.
CLOCK_SKEW_S = 4
MINIMUM_TORCH = (2, 8)  # as requirements.txt: older torchrun and gloo fail across hosts
ARCH_NAME = re.compile(r"(sm|compute)_(\d+)([af]?)")  # in torch.cuda.get_arch_list()
# The env row: what torch.distributed's networking reads, and which GPUs a job sees.
NETWORK_ENV = ("MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_IB_DISABLE",
               "NCCL_DEBUG", "CUDA_VISIBLE_DEVICES")
DRIVER = "/proc/driver/nvidia/version"
IB = "/sys/class/infiniband"  # InfiniBand and RoCE devices (mlx5_0 ...), which NCCL prefers to sockets
SIOCGIFADDR, SIOCGIFNETMASK = 0x8915, 0x891B  # Linux ioctls: an interface's IPv4 address and mask

ALLREDUCE_SIZES = [1024 * 4**i for i in range(9)]  # 1 KiB .. 64 MiB, as nccl-tests' -b 1K -e 64M -f 4
ALLREDUCE_SIZES_NCCL = ALLREDUCE_SIZES + [256 * 2**20, 2**30]  # NVLink and InfiniBand near their peak
ALLREDUCE_SLOW_S = 0.05  # ... unless 64 MiB took longer: that link is at its peak already
ALLREDUCE_BYTES_PER_SIZE = 256 * 2**20  # iterations per size: about this many bytes, 3..20 of them

Host = namedtuple("Host", "label local ssh")  # as lib/hosts.sh prints them: ssh, the command that reaches it


class UsageError(Exception):
    """A mistake in the command line or hosts file: one line, exit 2."""


# ---------------------------------------------------------------- the report on one machine
# This part also runs on the other hosts, streamed there: it needs nothing but the stdlib.

def gather_report():
    """Everything about this machine that decides whether it can join a job. A value it
    cannot have is None, with the reason in report["why_missing"]."""
    started, why = time.time(), {}
    report = {"hostname": socket.gethostname(), "os": platform.platform(), "python": platform.python_version(),
              "python_executable": sys.executable, **torch_facts(why)}
    report.update(driver=driver_version(why), compiler=find_compiler(report["gpus"], why),
                  gloo_address=gloo_address(), interfaces=interfaces(),
                  rdma_devices=sorted(os.listdir(IB)) if os.path.isdir(IB) else [],
                  env={name: os.environ[name] for name in NETWORK_ENV if name in os.environ},
                  ssh_connection=os.environ.get("SSH_CONNECTION"), why_missing=why)
    report["clock"] = [started, time.time()]
    return report


def torch_facts(why):
    """Versions, backends and GPUs as torch sees them."""
    facts = dict.fromkeys(["torch", "torchvision", "cuda_runtime", "cudnn", "nccl", "gloo_available",
                           "nccl_available", "arch_list"])
    facts["gpus"] = []
    try:
        import torch  # here: a host without torch must still report
        import torch.distributed as dist
    except Exception as exc:  # not only ImportError: a broken install can raise anything
        why.update(dict.fromkeys(facts, "no torch"), torch=f"does not import: {describe(exc)}")
        return facts
    facts.update(torch=torch.__version__, cuda_runtime=torch.version.cuda, arch_list=torch.cuda.get_arch_list(),
                 gloo_available=dist.is_available() and dist.is_gloo_available(),
                 nccl_available=dist.is_available() and dist.is_nccl_available())
    if torch.version.cuda is None:
        why["cuda_runtime"] = "CPU-only torch build"
    try:
        cudnn = torch.backends.cudnn.version()  # raises where the driver is too old
    except Exception as exc:
        cudnn, why["cudnn"] = None, describe(exc)
    if cudnn:  # 92400 is 9.24.0, and cuDNN 8's 8902 is 8.9.2
        major, rest = divmod(cudnn, 10000 if cudnn >= 90000 else 1000)
        facts["cudnn"] = f"{major}.{rest // 100}.{rest % 100}"
    elif "cudnn" not in why:
        why["cudnn"] = "torch has no cuDNN"
    try:
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # CPU-only builds have no NCCL to ask
        why["nccl"] = describe(exc)
    try:
        facts["gpus"] = [gpu_facts(torch, i, facts["arch_list"]) for i in range(torch.cuda.device_count())]
    except Exception as exc:  # a driver too old for this torch, MIG without CUDA_VISIBLE_DEVICES
        why["gpus"] = describe(exc)
    cannot = None if facts["gpus"] or "gpus" in why else gpus_torch_cannot_use(torch)
    if cannot:
        why["gpus"] = cannot
    try:
        import torchvision

        facts["torchvision"] = torchvision.__version__
    except Exception as exc:
        why["torchvision"] = f"torchvision does not import: {describe(exc)}"
    return facts


def gpu_facts(torch, i, arch_list):
    props = torch.cuda.get_device_properties(i)
    gpu = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
           "capability": f"{props.major}.{props.minor}",
           "torch_has_kernels": has_kernels_for((props.major, props.minor), arch_list)}
    try:  # starts a context, as a job does: fails on a GPU held in exclusive mode, or that needs a reset
        gpu["free_gib"] = round(torch.cuda.mem_get_info(i)[0] / 2**30, 1)
    except Exception as exc:
        gpu["error"] = describe(exc)
    return gpu


def gpus_torch_cannot_use(torch, dev=Path("/dev")):
    """Why torch counts no GPU where this process may open one's device file, or None. torch
    only warns where the driver fails (updated without a reboot, say)."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.hip or hidden in ("", "-1"):  # hidden on purpose
        return None
    gpu = next((path for path in sorted(dev.glob("nvidia[0-9]*")) if may_open(path)), None)
    if gpu is None:  # none, or a container or a scheduler's job given none
        return None
    if torch.version.cuda is None:
        return f"{gpu} is here, but torch {torch.__version__} is a CPU-only build: install a CUDA build"
    try:
        torch.cuda.init()  # raises what the count kept to a warning
    except Exception as exc:
        shown = "" if hidden is None else f" (CUDA_VISIBLE_DEVICES={hidden})"
        return (f"{gpu} is here, but {describe(exc)}{shown}: a driver too old for CUDA {torch.version.cuda}, "
                "or updated without a reboot? (nvidia-smi tells)")
    return None


def may_open(path):
    try:
        os.close(os.open(path, os.O_RDONLY))
        return True
    except OSError:  # absent, or denied (a cgroup that keeps a job from other jobs' GPUs)
        return False


def has_kernels_for(capability, arch_list):
    """Whether a torch built for arch_list (["sm_80", "sm_90a", "compute_90"]) runs on a GPU
    of capability (major, minor); a list of none of these (ROCm's gfx names) fits."""
    built = [arch for arch in arch_list if ARCH_NAME.fullmatch(arch)]
    return not built or any(arch_runs_on(arch, capability) for arch in built)


def arch_runs_on(arch, capability):
    """Machine code for X.Y runs on X.Z, Z >= Y; "a" code (sm_90a) on X.Y alone; PTX
    (compute_90), which the driver compiles, on X.Y and newer."""
    kind, number, suffix = ARCH_NAME.fullmatch(arch).groups()
    built = divmod(int(number), 10)
    if suffix == "a":
        return built == capability
    if kind == "compute" and not suffix:
        return built <= capability
    return built[0] == capability[0] and built[1] <= capability[1]  # (and "f": sm_100f)


def driver_version(why):
    """The kernel driver's version: torch does not expose it, the kernel module does."""
    with contextlib.suppress(OSError, TypeError):  # (TypeError: no match)
        return re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", Path(DRIVER).read_text())[1]
    why["driver"] = "no NVIDIA driver loaded"


def find_compiler(gpus, why):
    """The compiler torch.compile needs here: Triton's C compiler on GPUs, inductor's C++ one on CPUs."""
    c_compilers = [os.environ["CC"]] if "CC" in os.environ else ["gcc", "clang"]
    wanted = c_compilers if gpus else [os.environ.get("CXX", "g++")]
    found = next(filter(None, map(shutil.which, wanted)), None)
    if found is None:
        why["compiler"] = f"no {' or '.join(wanted)}: train.py --compile needs one"
    return found


def gloo_address():
    """Where gloo listens without GLOO_SOCKET_IFNAME: the first address of this host's name
    that can be bound, else 127.0.0.1."""
    with contextlib.suppress(OSError, UnicodeError):
        for family, kind, protocol, _, address in socket.getaddrinfo(socket.gethostname(), None,
                                                                     type=socket.SOCK_STREAM):
            with socket.socket(family, kind, protocol) as probe, contextlib.suppress(OSError):
                probe.bind(address)
                return address[0]
    return "127.0.0.1"


def interfaces():
    """[{"name": "eth0", "address": "10.0.0.5/24"}, ...], IPv4 then IPv6, from ioctls and
    /proc: a host needs nothing beyond Python."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):  # no IPv4 address
                address, mask = (fcntl.ioctl(sock.fileno(), op, request)[20:24] for op in (SIOCGIFADDR, SIOCGIFNETMASK))
                network = ipaddress.IPv4Interface(f"{socket.inet_ntoa(address)}/{socket.inet_ntoa(mask)}")
                found.append({"name": name, "address": str(network)})
    with contextlib.suppress(OSError):  # IPv6 off
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            hex_address, _, prefix, scope, _, name = line.split()
            if int(scope, 16) != 0x20:  # link-local: a job cannot use it
                address = ipaddress.IPv6Address(bytes.fromhex(hex_address))
                found.append({"name": name, "address": f"{address}/{int(prefix, 16)}"})
    return found


def describe(exc):
    return f"{type(exc).__name__}: {exc}"


# ---------------------------------------------------------------- presenting reports

def show_gpus(report):
    return [str(len(report["gpus"]))] + [
        f"{g['name']}, {g['memory_gib']} GiB, cc {g['capability']}"
        + ("" if g["torch_has_kernels"] else ", no kernels in this torch") for g in report["gpus"]]


def show_amp(report):
    """The --amp that is faster than fp32 here."""
    old = sorted({g["capability"] for g in report["gpus"] if int(g["capability"].split(".")[0]) < 8})
    if not report["gpus"]:
        return "bf16 (fp16 is many times slower than fp32 on a CPU)"
    return f"fp16 (bf16 is emulated and slow before Ampere: cc {', '.join(old)})" if old else "bf16, fp16"


def show_gloo(report):
    if len(gloo_ifname(report)) > 1:  # torch ignores a shorter one
        return f"GLOO_SOCKET_IFNAME={gloo_ifname(report)}"
    loopback = ipaddress.ip_address(report["gloo_address"].split("%")[0]).is_loopback
    return report["gloo_address"] + (" (loopback: set GLOO_SOCKET_IFNAME, as launch.sh does)" if loopback else "")


# (label, key, how to show it, whether a difference between hosts is marked).
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
    ("backends", "gloo_available", lambda r: ", ".join(b for b in ("gloo", "nccl") if r[f"{b}_available"]), True),
    ("GPUs", "gpus", show_gpus, True),
    ("driver", "driver", None, True),
    ("AMP", "torch", show_amp, True),
    ("compiler", "compiler", None, True),
    ("gloo address", "gloo_address", show_gloo, False),
    ("interfaces", "interfaces", lambda r: [f"{i['name']} {i['address']}" for i in r["interfaces"]], False),
    ("RDMA", "rdma_devices", lambda r: ", ".join(r["rdma_devices"]) or "none", True),
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
        reason = report["why_missing"].get(key)
        return [f"missing ({reason})" if reason else "missing"]
    return (value if isinstance(value, list) else [str(value)]) or ["(none)"]


def format_report(report):
    width = max(len(label) for label, *_ in ROWS)
    lines = []
    for label, key, show, _ in ROWS:
        first, *rest = cell(report, key, show)
        lines += [f"{label:<{width}}  {first}"] + [f"{'':<{width}}  {value}" for value in rest]
    return "\n".join(lines)


def format_table(labels, reports):
    """Hosts as columns, fields as rows; '*' marks a row whose values differ."""
    rows = [("status", [["error: " + r["error"]] if "error" in r else ["ok"] for r in reports], False)]
    reachable = [i for i, r in enumerate(reports) if "error" not in r]
    for label, key, show, marked in ROWS:
        cells = [cell(r, key, show) for r in reports]
        rows.append((label, cells, marked and any(cells[i] != cells[reachable[0]] for i in reachable)))
    label_width = 2 + max(len(label) for label, *_ in rows)
    widths = [max([len(labels[i])] + [len(line) for _, cells, _ in rows for line in cells[i]])
              for i in range(len(labels))]

    def line(first, columns):
        return "  ".join([f"{first:<{label_width}}"] + [f"{c:<{w}}" for c, w in zip(columns, widths)]).rstrip()

    table = [line("", labels), line("", ["-" * w for w in widths])]
    for label, cells, differs in rows:
        for n in range(max(len(c) for c in cells)):
            first = ("* " if differs else "  ") + label if n == 0 else ""
            table.append(line(first, [c[n] if n < len(c) else "" for c in cells]))
    if any(differs for *_, differs in rows):
        table.append("(* = differs between hosts)")
    return "\n".join(table)


# ---------------------------------------------------------------- problems

def public_version(version):
    """2.8.0 of 2.8.0+cu128: PyPI's and download.pytorch.org's wheels of one release; a
    label that names a commit (NGC's 2.8.0a0+5228986c39.nv25.06) is kept."""
    return re.sub(r"\+(cpu|cu\d+|rocm[\d.]+|xpu)$", "", version)


# What must be equal on every host, else init hangs or fails with a cryptic error. The CUDA
# runtime and NCCL only where there are GPUs: gloo mixes CPU-only and CUDA builds.
MUST_MATCH = [
    ("python", "python", lambda version: ".".join(version.split(".")[:2]), False),
    ("torch", "torch", public_version, False),
    ("torchvision", "torchvision", public_version, False),
    ("CUDA runtime", "cuda_runtime", str, True),
    ("NCCL", "nccl", str, True),
]


def find_problems(labels, reports, nproc=None):
    """One line per problem, host by host, each with its fix."""
    usable = [(label, r) for label, r in zip(labels, reports) if "error" not in r and r["torch"] is not None]
    uses_gpus = any(r["gpus"] for _, r in usable)
    references = {key: reference_host(usable, key, comparable) for _, key, comparable, _ in MUST_MATCH}
    problems = []
    for label, report in zip(labels, reports):
        if "error" in report:
            problems.append(f"{label}: {report['error']}")
        elif report["torch"] is None:
            why = report["why_missing"]["torch"]
            problems.append(f"{label}: torch {why} (interpreter {report['python_executable']})")
        else:
            problems += host_problems(label, report, nproc, uses_gpus)
            problems += differences(label, report, references, uses_gpus)
    return problems + clock_problems(usable)


def host_problems(label, report, nproc, uses_gpus):
    problems = []
    major, minor = map(int, re.match(r"(\d+)\.(\d+)", report["torch"]).groups())
    if (major, minor) < MINIMUM_TORCH:
        problems.append(f"{label}: torch {report['torch']} is older than {'.'.join(map(str, MINIMUM_TORCH))}, "
                        "whose torchrun and gloo fail across hosts (docs/check_env.md): upgrade torch")
    problems += missing_interfaces(label, report)
    gpus = report["gpus"]
    if report["why_missing"].get("gpus"):
        return problems + [f"{label}: CUDA cannot use the GPUs: {report['why_missing']['gpus']}"]
    if uses_gpus and len(gpus) < (nproc or 1):
        problems.append(f"{label}: --nproc {nproc} but only {len(gpus)} GPU(s) visible" if nproc else
                        f"{label}: no GPU visible, but other hosts have GPUs (nccl and gloo do not mix)")
    archs = " ".join(a for a in report["arch_list"] or [] if ARCH_NAME.fullmatch(a))
    for gpu in {g["capability"]: g for g in gpus if not g["torch_has_kernels"]}.values():
        problems.append(f"{label}: torch {report['torch']}, built for {archs}, has no kernels for its {gpu['name']} "
                        f"(cc {gpu['capability']}): install a torch built for sm_{gpu['capability'].replace('.', '')}")
    for i, gpu in enumerate(gpus):
        if "error" in gpu:
            problems.append(f"{label}: GPU {i} ({gpu['name']}) cannot be used: {gpu['error']}")
        elif gpu["free_gib"] < gpu["memory_gib"] / 2:
            problems.append(f"{label}: GPU {i} ({gpu['name']}) has {gpu['free_gib']} GiB free of {gpu['memory_gib']}: "
                            "other processes hold the rest (one left from an earlier job? nvidia-smi)")
    return problems


def gloo_ifname(report):
    """What the job sees: launch.sh sends this machine's value to every host, over the host's own."""
    return os.environ.get("GLOO_SOCKET_IFNAME", report["env"].get("GLOO_SOCKET_IFNAME", ""))


def missing_interfaces(label, report):
    """GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME naming no interface of the host: names differ
    from host to host (eth1, ens5), and gloo then fails at start-up, NCCL at its first collective."""
    names = sorted({interface["name"] for interface in report["interfaces"] or []})
    if not names:  # unknown
        return []
    problems = []
    gloo = gloo_ifname(report)
    missing = [name for name in gloo.split(",") if name and name not in names]
    if missing:
        problems.append(f"{label}: GLOO_SOCKET_IFNAME={gloo}, but it has no interface {', '.join(missing)} "
                        f"(only {', '.join(names)})")
    # NCCL's: name prefixes, "=" first for exact names, "^" first for names to avoid; each may end in ":PORT".
    nccl = os.environ.get("NCCL_SOCKET_IFNAME", report["env"].get("NCCL_SOCKET_IFNAME", ""))
    if nccl and not nccl.startswith("^"):
        wanted = [item.split(":")[0] for item in nccl.removeprefix("=").split(",") if item.split(":")[0]]
        if not any(name == w if nccl.startswith("=") else name.startswith(w) for name in names for w in wanted):
            problems.append(f"{label}: NCCL_SOCKET_IFNAME={nccl} matches none of its interfaces ({', '.join(names)})")
    return problems


def reference_host(usable, key, comparable):
    """(label, report) of the first host with the most common value: one odd host, the first
    one included, is named alone."""
    values = [comparable(report[key] or "missing") for _, report in usable]
    counts = Counter(values)
    return next((host for host, value in zip(usable, values) if counts[value] == max(counts.values())), None)


def differences(label, report, references, uses_gpus):
    found = []
    for name, key, comparable, only_with_gpus in MUST_MATCH:
        ref_label, ref = references[key]
        mine, theirs = report[key] or "missing", ref[key] or "missing"
        if comparable(mine) != comparable(theirs) and (uses_gpus or not only_with_gpus):
            why = report["why_missing"].get(key) if report[key] is None else None
            found.append(f"{label}: {name} {f'missing ({why})' if why else mine} differs from {ref_label} ({theirs})")
    return found


def clock_problems(usable):
    """Each host whose clock is CLOCK_SKEW_S or more from the one most others agree with, or
    the one most ahead of the one most behind. clock_offset: a range, from this machine's."""
    offsets = {label: report["clock_offset"] for label, report in usable if "clock_offset" in report}
    labels = list(offsets)

    def apart(a, b):
        return max(offsets[a][0] - offsets[b][1], offsets[b][0] - offsets[a][1]) >= CLOCK_SKEW_S

    def problem(a, b):
        difference = (sum(offsets[a]) - sum(offsets[b])) / 2
        return (f"{a}: its clock is about {abs(difference):.0f} s {'ahead of' if difference > 0 else 'behind'} "
                f"{b}'s, and torchrun's rendezvous drops a host at 15 s off: sync them (NTP: chrony)")

    reference = max(labels, key=lambda a: sum(not apart(a, b) for b in labels), default=None)
    found = [problem(label, reference) for label in labels if apart(label, reference)]
    if labels and not found:
        ahead = max(labels, key=lambda label: offsets[label][0])
        behind = min(labels, key=lambda label: offsets[label][1])
        found = [problem(ahead, behind)] if apart(ahead, behind) else []
    return found


# ---------------------------------------------------------------- gathering reports

def read_hosts(path):
    """The hosts of a hosts file, as lib/hosts.sh, their one parser, reads them."""
    result = subprocess.run(["bash", str(HERE / "lib" / "hosts.sh"), path], capture_output=True, text=True,
                            timeout=60)
    if result.returncode != 0:
        raise UsageError(result.stderr.strip().removeprefix("hosts.sh: ") or f"lib/hosts.sh exited {result.returncode}")
    return [Host(fields[0], fields[1] == "yes", fields[2:])
            for fields in (line.split("\t") for line in result.stdout.splitlines())]


def host_command(host, python):
    """The command that runs `python - --json` on host: over ssh, unless local."""
    if host.local:
        return [python, "-", "--json"]
    return [*host.ssh, "exec " + shlex.join([python, "-", "--json"])]


def run_all(commands, labels):
    """Run every command at once, each fed this file; [(exit status, stdout, stderr)], the
    status None where a command could not start or did not end within REPORT_TIMEOUT_S."""
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        try:
            for i, argv in enumerate(commands):
                procs.append(start(argv, f"{tmp}/{i}"))
            late = wait_for(procs, labels)
        finally:  # a timeout, Ctrl-C or SIGTERM: no command outlives this one
            for proc in procs:
                if isinstance(proc, subprocess.Popen) and proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        return [(None, "", proc) if isinstance(proc, str) else
                (None, "", f"no answer within {REPORT_TIMEOUT_S} s") if proc in late else
                (proc.returncode, *(Path(f"{tmp}/{i}.{n}").read_text(errors="replace") for n in ("out", "err")))
                for i, proc in enumerate(procs)]


def start(argv, path):
    """A Popen of argv in a session of its own, its output to files (an ssh ControlMaster
    holds a pipe open as long as the remote command runs); or why it cannot start."""
    try:
        with open(__file__, "rb") as stdin, open(f"{path}.out", "wb") as out, open(f"{path}.err", "wb") as err:
            return subprocess.Popen(argv, stdin=stdin, stdout=out, stderr=err, start_new_session=True)
    except FileNotFoundError as exc:
        return f"cannot run {exc.filename}: not found"


def wait_for(procs, labels):
    """[those of procs still running after REPORT_TIMEOUT_S]; those after PATIENCE_S are named."""
    began, named = time.monotonic(), False
    while True:
        late = {p: label for label, p in zip(labels, procs) if isinstance(p, subprocess.Popen) and p.poll() is None}
        if not late or time.monotonic() > began + REPORT_TIMEOUT_S:
            break
        if not named and time.monotonic() > began + PATIENCE_S:
            print(f"check_env.py: still waiting for {', '.join(late.values())} after {PATIENCE_S} s (giving up at "
                  f"{REPORT_TIMEOUT_S} s)", file=sys.stderr, flush=True)
            named = True
        time.sleep(0.05)
    return list(late)


def parse_report(status, stdout, asked, answered):
    """The report that `check_env.py --json` printed (after a login banner, maybe), with the
    range of its clock's offset from this machine's; None if there is none."""
    lines = stdout.splitlines()
    if status != 0 or "{" not in lines:
        return None
    report = json.loads("\n".join(lines[len(lines) - lines[::-1].index("{") - 1:]))
    report["clock_offset"] = [report["clock"][1] - answered, report["clock"][0] - asked]
    return report


def failure(status, stderr, python, remote, hostfile=None):
    """Why a report could not be had, in the words a user needs to fix it."""
    if status == 255 and remote:  # ssh's own: lib/hosts.sh says why, as it does for launch.sh
        why = subprocess.run(["bash", str(HERE / "lib" / "hosts.sh"), "--ssh-failure", hostfile], input=stderr,
                             capture_output=True, text=True, timeout=60)
        return why.stdout.strip() or stderr.strip()
    reason = ([line.rstrip("\r") for line in stderr.strip().splitlines()] or [""])[-1]
    if status is None:
        return reason
    if status == 127:
        return f"{python} not found (use --python)"
    return f"{python} failed with exit status {status}: {reason}"


def host_reports(hosts, python, hostfile):
    """(labels, reports) of the hosts, through SSH."""
    labels, asked = [host.label for host in hosts], time.time()
    results = run_all([host_command(host, python) for host in hosts], labels)
    answered = time.time()
    return labels, [parse_report(status, out, asked, answered)
                    or {"error": failure(status, err, python, not host.local, hostfile)}
                    for host, (status, out, err) in zip(hosts, results)]


def slurm_command(python, nodes):
    # --ntasks: else srun takes SLURM_NTASKS, several tasks a node; --overlap: beside a step
    # that holds the nodes (salloc's, say); --label: "TASK: " before each line, one task a node.
    return ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--overlap",
            "--kill-on-bad-exit=0", "--label", python, "-", "--json"]


def slurm_reports(python):
    """(node names, reports) of every node of this allocation, through srun."""
    if "SLURM_JOB_ID" not in os.environ:
        raise UsageError("--slurm runs inside a SLURM allocation (salloc or sbatch): SLURM_JOB_ID is not set")
    try:
        listed = subprocess.run(["scontrol", "show", "hostnames"], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UsageError("--slurm needs SLURM's scontrol, and there is none on PATH") from None
    nodes = listed.stdout.split()
    if not nodes:
        raise UsageError(f"scontrol lists no node of job {os.environ['SLURM_JOB_ID']}: "
                         f"{listed.stderr.strip() or 'is SLURM_JOB_NODELIST set?'}")
    asked = time.time()
    [(status, out, err)] = run_all([slurm_command(python, len(nodes))], [f"srun ({len(nodes)} nodes)"])
    answered = time.time()
    tasks = [[[], []] for _ in nodes]
    for stream, text in enumerate((out, err)):
        for task, line in re.findall(r"^ *(\d+): ?(.*)$", text, re.M):
            if int(task) < len(nodes):
                tasks[int(task)][stream].append(line)
    reports = []
    for task_out, task_err in tasks:
        report = parse_report(0, "\n".join(task_out), asked, answered)
        reason = (task_err or err.strip().splitlines() or [f"srun exited {status}"])[-1]
        reports.append(report or {"error": f"no report from srun: {reason}"})
    return nodes, reports


# ---------------------------------------------------------------- all-reduce

def allreduce_worker(timeout):
    """A rank under torchrun (launch.sh, train.sbatch): time all-reduce; rank 0 prints the table."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device, backend = torch.device("cpu"), "gloo"
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", int(os.environ["LOCAL_RANK"])), "nccl"
        torch.cuda.set_device(device)
    # The timeout bounds every wait: a node that cannot reach the others fails, not hangs.
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout),
                            device_id=device if backend == "nccl" else None)
    rows = []
    for size in ALLREDUCE_SIZES_NCCL if backend == "nccl" else ALLREDUCE_SIZES:
        if size > ALLREDUCE_SIZES[-1] and rows[-1]["seconds"] > ALLREDUCE_SLOW_S:
            break
        rows.append(time_allreduce(torch, dist, size, device, rank, world))
    if rank == 0:
        print(format_allreduce(backend, int(os.environ.get("GROUP_WORLD_SIZE", 1)), world, rows), flush=True)


def time_allreduce(torch, dist, size, device, rank, world):
    x = torch.empty(size // 4, dtype=torch.float32, device=device)
    x.fill_(rank + 1)  # the first warm-up checks the sum, as nccl-tests' #wrong
    dist.all_reduce(x)
    correct = (x == world * (world + 1) / 2).all().to(torch.int32)
    dist.all_reduce(correct, op=dist.ReduceOp.MIN)
    x.zero_()  # zeros stay zeros: no overflow to inf while timing
    for _ in range(2):
        dist.all_reduce(x)
    iterations = max(3, min(20, ALLREDUCE_BYTES_PER_SIZE // size))
    synchronize = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iterations):
        dist.all_reduce(x)
    synchronize()
    seconds = torch.tensor([(time.perf_counter() - start) / iterations], device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's time is the collective's
    return {"bytes": size, "seconds": seconds.item(), "correct": bool(correct)}


def format_allreduce(backend, nodes, world, rows):
    lines = [f"all-reduce, float32 sum, {backend}, {nodes} node(s), {world} ranks",
             f"{'size':>9} {'time(us)':>10} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}  check"]
    busbws = []
    for row in rows:
        algbw = row["bytes"] / row["seconds"] / 1e9
        busbws.append(algbw * 2 * (world - 1) / world)  # what each link carries in a ring all-reduce
        lines.append(f"{size_text(row['bytes']):>9} {row['seconds'] * 1e6:>10.1f} {algbw:>12.4g} {busbws[-1]:>12.4g}  "
                     + ("ok" if row["correct"] else "WRONG SUM"))
    lines.append(f"busbw at {size_text(rows[-1]['bytes'])}: {busbws[-1]:.4g} GB/s (averaged over every size, as "
                 f"nccl-tests' \"Avg bus bandwidth\": {sum(busbws) / len(busbws):.4g} GB/s)")
    return "\n".join(lines)


def size_text(nbytes):
    return f"{nbytes // 1024} KiB" if nbytes < 2**20 else f"{nbytes // 2**20} MiB"


def run_allreduce(args, nproc):
    """Become torchrun here (--standalone), or launch.sh on the hosts, each running this file's worker."""
    worker = [str(Path(__file__).resolve()), "--allreduce", f"--timeout={args.timeout}"]
    argv = [args.python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "--local-addr=127.0.0.1", *worker]  # (127.0.0.1: this host's name may not resolve)
    if args.hosts:
        torchrun = Path(args.python).parent / "torchrun"  # the interpreter's, as the report ran
        options = ["--torchrun", str(torchrun)] if Path(args.python).is_absolute() and torchrun.exists() else []
        argv = ["bash", str(HERE / "launch.sh"), *options, "--workdir", str(HERE), args.hosts, str(nproc), *worker]
    print(f"\nall-reduce: {shlex.join(argv)}", flush=True)
    os.execvp(argv[0], argv)  # it takes signals and cleans up itself


# ---------------------------------------------------------------- command line

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--hosts", metavar="FILE", help="compare every host of FILE ([user@]host[:port] lines)")
    where.add_argument("--slurm", action="store_true", help="compare every node of this SLURM allocation")
    parser.add_argument("--json", action="store_true", help="print the report(s) and problems as JSON")
    parser.add_argument("--nproc", type=positive_int, metavar="N", help="processes per host (with GPUs: N each)")
    parser.add_argument("--python", metavar="PATH", default=sys.executable,
                        help="Python on every host, found on its PATH if not absolute (default: %(default)s)")
    parser.add_argument("--allreduce", action="store_true",
                        help="time all-reduce (algbw, busbw): across the hosts with --hosts, else here")
    parser.add_argument("--timeout", type=positive_int, default=30, metavar="S",
                        help="--allreduce: seconds a rank waits for the others (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.allreduce and args.json:
        parser.error("argument --json: not allowed with --allreduce, which prints a table")
    if args.allreduce and args.slurm:
        parser.error("argument --slurm: not with --allreduce; use sbatch train.sbatch 1 check_env.py --allreduce")
    return args


def positive_int(text):
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return int(text)


def compare(args):
    """--hosts or --slurm: every host's report, the table, the problems; then --allreduce."""
    hosts = None if args.slurm else read_hosts(args.hosts)
    labels, reports = slurm_reports(args.python) if args.slurm else host_reports(hosts, args.python, args.hosts)
    problems = find_problems(labels, reports, args.nproc)
    nproc = args.nproc or max(1, min(len(r.get("gpus") or []) for r in reports))  # one per GPU, or 1 on CPU
    if args.allreduce and not problems and len(labels) * nproc < 2:
        raise UsageError(f"--allreduce needs 2 processes or more, and this is {len(labels)} host x {nproc} process: "
                         "add hosts, or --nproc 2")
    if args.json:
        print(json.dumps({"hosts": dict(zip(labels, reports)), "problems": problems}, indent=2))
        return 1 if problems else 0
    print(format_table(labels, reports) + "\n")
    if problems:
        print(f"{len(problems)} problem(s):", *problems, sep="\n")
        return 1
    print(f"OK: all {len(labels)} host(s) match on python, torch, torchvision, CUDA runtime and NCCL")
    if args.allreduce:
        return run_allreduce(args, nproc)
    return 0


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.allreduce and "RANK" in os.environ:  # a rank under torchrun
            allreduce_worker(args.timeout)
            sys.stdout.flush()
            os._exit(0)  # not the process group's teardown, which can hang or abort after the work is done
        if args.hosts or args.slurm:
            return compare(args)
        if args.allreduce:
            if not args.nproc:
                try:
                    import torch  # one process per GPU, by default
                except ImportError:
                    raise UsageError(f"--allreduce needs torch, and {sys.executable} has none") from None
                args.nproc = torch.cuda.device_count()
            if args.nproc < 2:
                raise UsageError("--allreduce needs 2 processes or more: add --nproc 2")
            return run_allreduce(args, args.nproc)
    except UsageError as exc:
        print(f"check_env.py: {exc}", file=sys.stderr)
        return 2
    report = gather_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    problems = find_problems([report["hostname"]], [report], args.nproc)
    print(format_report(report), *([f"\n{len(problems)} problem(s):"] + problems if problems else []), sep="\n")
    return 1 if problems else 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # unwinds: kills what runs
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
