"""Tests for check_env.py that need no cluster: the local report, the
comparison logic on synthetic reports, hosts-file validation, the SSH
command line, node clean-up, and a real all-reduce on this machine."""

import contextlib
import copy
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from conftest import HIDDEN_GPUS, REPO, run, skip_or_fail

sys.path.insert(0, str(REPO))
import check_env  # noqa: E402


def run_check_env(args, timeout, env=None):
    return run([sys.executable, REPO / "check_env.py", *args], timeout=timeout, env=env or {})


# --------------------------------------------------------------------------
# The local report
# --------------------------------------------------------------------------

REPORT_FIELDS = {
    "hostname", "os", "python", "python_executable", "torch", "torchvision",
    "cuda_runtime", "cudnn", "nccl", "gloo_available", "nccl_available",
    "gpus", "driver", "interfaces", "rdma_devices", "rdma_ports_inactive", "locked_memory", "env", "ssh_connection",
    "clock",
    "why_missing",
}  # fmt: skip


def test_local_report_has_every_field(monkeypatch):
    import torch

    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("MASTER_PORT", "1234")
    report = check_env.gather_report()
    assert set(report) == REPORT_FIELDS
    assert check_env.STARTED <= report["clock"][0] <= report["clock"][1] <= time.time()
    assert report["python_executable"] == sys.executable
    assert report["torch"] == torch.__version__
    assert report["gloo_available"] is True
    assert {"NCCL_DEBUG": "INFO", "MASTER_PORT": "1234"}.items() <= report["env"].items()
    if sys.platform == "linux":  # elsewhere the report says why it lists none
        assert {"name": "lo", "address": "127.0.0.1/8"} in report["interfaces"]
    assert len(report["gpus"]) == torch.cuda.device_count()
    # Every value torch could not give comes with a reason.
    assert all(key in report["why_missing"] for key, value in report.items() if value is None)
    text = check_env.format_report(report)
    for label in ("hostname", "python", "torch", "NCCL", "GPUs", "interfaces", "env"):
        assert f"\n{label} " in "\n" + text


def test_json_report_with_every_gpu_hidden():
    # A fresh process: CUDA reads CUDA_VISIBLE_DEVICES once, when it starts.
    result = run_check_env(["--json"], timeout=60, env=HIDDEN_GPUS)  # (run() hides them too)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == REPORT_FIELDS
    assert report["gpus"] == []
    assert report["env"]["CUDA_VISIBLE_DEVICES"] == ""


def test_report_without_torch_says_missing(monkeypatch):
    # None in sys.modules makes `import torch` raise ImportError.
    monkeypatch.setitem(sys.modules, "torch", None)
    report = check_env.gather_report()
    assert report["torch"] is None and report["gpus"] == []
    assert "does not import" in report["why_missing"]["torch"]
    assert "missing (no torch)" in check_env.format_report(report)


def test_report_off_linux_says_why_it_lists_no_interface(monkeypatch):
    """On a Mac, where the tests may run, every Linux ioctl failed: an empty list, which
    the report's formatting took the first line of and stopped with an IndexError."""
    monkeypatch.setattr(sys, "platform", "darwin")
    report = check_env.gather_report()
    assert report["interfaces"] is None
    assert "\ninterfaces    missing (listed on Linux only, not on darwin)\n" in check_env.format_report(report)
    report["interfaces"] = []
    assert "\ninterfaces    (none)\n" in check_env.format_report(report)


def test_report_without_torchvision_says_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    report = check_env.gather_report()
    assert report["torch"] is not None and report["torchvision"] is None
    assert "torchvision does not import" in report["why_missing"]["torchvision"]


def test_gpus_cuda_cannot_use_are_a_reason_not_a_crash(monkeypatch):
    import torch

    def too_old(*args):
        raise RuntimeError("The NVIDIA driver on your system is too old")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # NVML counts them
    monkeypatch.setattr(torch.cuda, "get_device_properties", too_old)
    monkeypatch.setattr(torch.backends.cudnn, "version", too_old)
    report = check_env.gather_report()
    assert report["gpus"] == [] and report["cudnn"] is None
    assert "driver on your system is too old" in report["why_missing"]["gpus"]
    assert "driver on your system is too old" in report["why_missing"]["cudnn"]
    fetched = {**report, "clock_offset": [-0.1, 0.1]}  # as fetch_report adds it
    assert check_env.find_problems(["a", "b"], [host_report("a", "10.0.0.1/24"), fetched])[0].startswith(
        "b: CUDA cannot use the GPUs: RuntimeError: The NVIDIA driver on your system is too old"
    )


def test_gloo_binds_to_the_interface_of_the_nodes_address_unless_set_there():
    report = host_report("a", "10.0.0.1/24")
    assert check_env.gloo_interface(report, "10.0.0.1") == ["env", "GLOO_SOCKET_IFNAME=eth0"]
    assert check_env.gloo_interface(report, "127.0.0.1") == ["env", "GLOO_SOCKET_IFNAME=lo"]
    assert check_env.gloo_interface(report, "192.168.9.9") == []  # on no interface: gloo's own choice
    assert check_env.gloo_interface(report, "::ffff:10.0.0.1") == ["env", "GLOO_SOCKET_IFNAME=eth0"]
    with_interfaces(report, ("eth1", "fd00:7::2/64"))
    assert check_env.gloo_interface(report, "fd00:7:0::2") == ["env", "GLOO_SOCKET_IFNAME=eth1"]
    assert check_env.gloo_interface(report, None) == []  # its sshd set no SSH_CONNECTION
    report["env"] = {"GLOO_SOCKET_IFNAME": "ib0"}  # the host's own, or forwarded from here
    assert check_env.gloo_interface(report, "10.0.0.1") == []


def test_ipv6_addresses_are_read_from_proc_without_link_local_ones():
    if_inet6 = ("fe8000000000000000fc00fffe000001 04 40 20 80     eth0\n"
                "00000000000000000000000000000001 01 80 10 80       lo\n"
                "fd000007000000000000000000000002 04 40 00 80     eth0\n")
    assert check_env.ipv6_addresses(if_inet6) == [
        {"name": "lo", "address": "::1/128"}, {"name": "eth0", "address": "fd00:7::2/64"}]


@pytest.mark.parametrize("buffered", [True, False], ids=["buffered", "unbuffered"])
def test_output_into_a_closed_pipe_stops_without_a_traceback(buffered):
    """As in `check_env.py | head -1`, once head has exited. Buffered, as Python writes to a
    pipe unless PYTHONUNBUFFERED is set, the report reached the pipe only at exit."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env.update(HIDDEN_GPUS, **({} if buffered else {"PYTHONUNBUFFERED": "1"}))
    proc = subprocess.Popen([sys.executable, REPO / "check_env.py"], stdout=write_end, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, env=env)
    os.close(write_end)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert (proc.returncode, err) == (1, "")


def test_locked_memory_is_unlimited_with_cap_ipc_lock():
    """RDMA may pin past ulimit -l where the process has CAP_IPC_LOCK, as root has."""
    if shutil.which("setpriv") is None:
        skip_or_fail("setpriv (util-linux) drops capabilities")
    def limit(*prefix):
        return subprocess.run(
            [*prefix, sys.executable, "-c", "import check_env; print(check_env.locked_memory_limit())"],
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_MEMLOCK, (65536, 65536)),
            cwd=REPO, capture_output=True, text=True, check=True, timeout=60).stdout
    assert limit("setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock") == "65536\n"
    status = Path("/proc/self/status").read_text()
    has_it = int(re.search(r"^CapEff:\s*(\w+)$", status, re.M)[1], 16) >> 14 & 1  # root's, unless dropped
    assert limit() == ("unlimited (CAP_IPC_LOCK)\n" if has_it else "65536\n")


def test_open_files_are_allowed_for_hundreds_of_hosts():
    """Each host's ssh holds 3 files open here: 1024 would fail past 340 hosts."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    probe = "import check_env, resource; check_env.allow_open_files(3000); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])"
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard)), timeout=60)
    assert int(result.stdout) == (3000 if hard == resource.RLIM_INFINITY else min(3000, hard))


def test_help_explains_the_options():
    result = run_check_env(["--help"], timeout=30)
    assert result.returncode == 0
    for text in ("--hosts", "--nproc", "--python", "--allreduce", "SSH_COMMAND", "Exit status"):
        assert text in result.stdout


@pytest.mark.parametrize("capability, arch_list, has_kernels", [
    ((9, 0), ["sm_75", "sm_80", "sm_86", "sm_90"], True),
    ((8, 9), ["sm_75", "sm_80", "sm_86", "sm_90"], True),  # an sm_89 runs sm_86's machine code
    ((8, 0), ["sm_75", "sm_86", "sm_90"], False),  # but an sm_80 does not
    ((7, 0), ["sm_75", "sm_80", "sm_90"], False),  # a V100 under CUDA 13's torch
    ((12, 0), ["sm_75", "sm_80", "sm_86", "sm_90"], False),
    ((12, 0), ["sm_80", "sm_90a", "compute_90"], True),  # PTX, compiled by the driver
    ((8, 6), ["sm_90", "compute_90"], False),  # but only for 9.0 and up
    ((12, 0), ["sm_90", "compute_90a"], False),  # and "a" PTX for 9.0 alone
    ((10, 3), ["sm_90", "sm_100a"], False),  # "a" machine code runs on its own X.Y alone
    ((10, 3), ["sm_90", "sm_100f"], True),  # "f" code on its family's
    ((6, 0), [], True),  # no list to go by
    ((9, 0), ["gfx90a", "gfx942"], True),  # ROCm's: not CUDA's to judge
])
def test_gpus_run_kernels_built_for_their_capability(capability, arch_list, has_kernels):
    assert check_env.has_kernels_for(capability, arch_list) is has_kernels


def fake_torch(cuda="13.0", init_error=None):
    """As much of torch as gpus_torch_cannot_use reads: it counted no GPU."""
    def init():
        if init_error:
            raise init_error
    return SimpleNamespace(__version__="2.14.1", version=SimpleNamespace(cuda=cuda, hip=None),
                           cuda=SimpleNamespace(init=init))


NO_DRIVER = RuntimeError("Found no NVIDIA driver on your system.")


@pytest.mark.parametrize("devices, visible, torch, why", [
    (["nvidia0"], None, fake_torch(init_error=NO_DRIVER),
     "{dev}/nvidia0 is here, but RuntimeError: Found no NVIDIA driver on your system."),
    (["nvidia0"], "GPU-5e1f", fake_torch(init_error=RuntimeError("No CUDA GPUs are available")),
     "{dev}/nvidia0 is here, but RuntimeError: No CUDA GPUs are available (CUDA_VISIBLE_DEVICES=GPU-5e1f)"),
    (["nvidia0"], None, fake_torch(cuda=None), "{dev}/nvidia0 is here, but torch 2.14.1 is a CPU-only build"),
    (["nvidia0"], "", fake_torch(init_error=NO_DRIVER), None),  # hidden on purpose
    (["nvidia0"], "-1", fake_torch(init_error=NO_DRIVER), None),
    (["nvidiactl"], None, fake_torch(init_error=NO_DRIVER), None),  # no GPU's device to open
], ids=["driver_fails", "visible_names_none", "cpu_build", "hidden", "hidden_minus_one", "no_gpu"])
def test_gpus_that_torch_cannot_use_are_named(tmp_path, monkeypatch, devices, visible, torch, why):
    """torch counts 0 GPUs, and raises nothing, where the driver fails: it only warns."""
    for name in devices:
        (tmp_path / name).touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    expected = why and why.format(dev=tmp_path)
    assert check_env.gpus_torch_cannot_use(torch, dev=tmp_path) == expected


def test_cudnn_version_is_readable():
    assert check_env.cudnn_version_string(92400) == "9.24.0"
    assert check_env.cudnn_version_string(8902) == "8.9.2"


@pytest.mark.parametrize("mapped, version", [
    ("7f3a1c000000-7f3a1c200000 r-xp 00000000 08:01 42 /venv/site-packages/nvidia/nccl/lib/libnccl.so.2\n",
     "2.28.9"),  # what the library says
    ("7f3a1c000000-7f3a1c200000 r-xp 00000000 08:01 42 /home/me/my venv/nvidia/nccl/lib/libnccl.so.2\n",
     "2.28.9"),  # a path with a space
    ("7f3a1c000000-7f3a1c200000 r-xp 00000000 08:01 42 /venv/site-packages/torch/lib/libtorch_cuda.so\n",
     "2.27.3"),  # NCCL linked into torch: torch's word
])
def test_nccl_version_is_the_loaded_librarys(tmp_path, monkeypatch, mapped, version):
    """torch.cuda.nccl.version() is the NCCL torch was built with, alike on every host."""
    class Library:
        def __init__(self, path):
            assert path == mapped.split(" 42 ")[1].rstrip("\n")

        def ncclGetVersion(self, number):
            number._obj.value = 22809
            return 0  # ncclSuccess

    monkeypatch.setattr(check_env.ctypes, "CDLL", Library)
    maps = tmp_path / "maps"
    maps.write_text(mapped)
    torch = SimpleNamespace(cuda=SimpleNamespace(nccl=SimpleNamespace(version=lambda: (2, 27, 3))))
    assert check_env.nccl_version(torch, maps) == version


def test_rdma_ports_that_are_not_up_are_shown(tmp_path):
    """NCCL leaves them out: that host holds the whole job to its bandwidth."""
    for device, port, state in [("mlx5_0", 1, "4: ACTIVE"), ("mlx5_1", 1, "1: DOWN"), ("mlx5_1", 2, "2: INIT")]:
        (tmp_path / device / "ports" / str(port)).mkdir(parents=True)
        (tmp_path / device / "ports" / str(port) / "state").write_text(state + "\n")
    inactive = check_env.rdma_ports_inactive(tmp_path)
    assert inactive == ["mlx5_1 port 1 DOWN", "mlx5_1 port 2 INIT"]
    report = host_report("a", "10.0.0.1/24", rdma_devices=["mlx5_0", "mlx5_1"], rdma_ports_inactive=inactive,
                         locked_memory="unlimited")
    assert check_env.show_rdma(report) == "mlx5_0, mlx5_1; mlx5_1 port 1 DOWN; mlx5_1 port 2 INIT; memlock unlimited"


def test_nccl_version_is_readable():
    assert check_env.nccl_version_string(23007) == "2.30.7"
    assert check_env.nccl_version_string(2708) == "2.7.8"  # before 2.9


# --------------------------------------------------------------------------
# Comparing synthetic reports
# --------------------------------------------------------------------------

BASE = {
    "hostname": "a",
    "os": "Linux",
    "python": "3.11.7",
    "python_executable": "/opt/py/bin/python",
    "torch": "2.14.1+cu130",
    "torchvision": "0.29.1+cu130",
    "cuda_runtime": "13.0",
    "cudnn": "9.24.0",
    "nccl": "2.30.7",
    "gloo_available": True,
    "nccl_available": True,
    "gpus": [],
    "driver": None,
    "interfaces": [{"name": "lo", "address": "127.0.0.1/8"}, {"name": "eth0", "address": "10.0.0.1/24"}],
    "rdma_devices": [],
    "rdma_ports_inactive": [],
    "locked_memory": "unlimited",
    "env": {},
    "clock": [1796400000.0, 1796400001.5],
    "clock_offset": [-0.2, 0.1],  # from this machine's, as fetch_report finds it
    "why_missing": {"driver": "no NVIDIA driver loaded"},
}


def host_report(name, address, **changes):
    """name's report, as gathered over SSH from 10.0.0.100 at address (its eth0)."""
    report = copy.deepcopy(BASE)
    report["hostname"] = name
    report["interfaces"][1]["address"] = address
    report["ssh_connection"] = f"10.0.0.100 52000 {address.split('/')[0]} 22"
    report.update(changes)
    return report


def without_torch(name, address):
    facts = ("torch", "torchvision", "cuda_runtime", "cudnn", "nccl", "gloo_available", "nccl_available")
    report = host_report(name, address, **dict.fromkeys(facts), python="3.11.2", python_executable="/usr/bin/python3")
    report["why_missing"] = dict.fromkeys(facts, "no torch")
    report["why_missing"]["torch"] = "does not import: ModuleNotFoundError: No module named 'torch'"
    return report


def gpus(n):
    return [{"name": "NVIDIA H100", "memory_gib": 79.1, "capability": "9.0", "torch_has_kernels": True,
             "free_gib": 78.6}] * n


def gpus_with(n, **second):
    """n GPUs, the second with the values given."""
    return [gpu if i != 1 else {**gpu, **second} for i, gpu in enumerate(gpus(n))]


LABELS = ["a", "b", "c"]
LOCALHOST = check_env.Host("localhost", None, "localhost", None, True)  # this machine, no ssh
BUSY = "CUDA-capable device(s) is/are busy or unavailable"  # (CUDA's words)


def with_interfaces(report, *interfaces):
    report["interfaces"] += [{"name": name, "address": address} for name, address in interfaces]
    return report


def three_hosts(b=None, c=None):
    """Three matching hosts, with b and c replaced where given."""
    return [
        host_report("a", "10.0.0.1/24"),
        b or host_report("b", "10.0.0.2/24"),
        c or host_report("c", "10.0.0.3/24"),
    ]


@pytest.mark.parametrize(
    "reports, nproc, expected",
    [
        (three_hosts(), None, []),
        (
            three_hosts(b=host_report("b", "10.0.0.2/24", torch="2.13.0+cu130")),
            None,
            ["b: torch 2.13.0+cu130 differs from a (2.14.1+cu130)"],
        ),
        (  # the first host is the odd one: it alone is named
            [host_report("a", "10.0.0.1/24", torch="2.13.0+cu130"), *three_hosts()[1:]],
            None,
            ["a: torch 2.13.0+cu130 differs from b (2.14.1+cu130)"],
        ),
        (
            [host_report(n, f"10.0.0.{i}/24", gpus=gpus(1), nccl=nccl)
             for i, (n, nccl) in enumerate(zip(LABELS, ["2.30.7", "2.30.7", "2.27.3"]), 1)],
            None,
            ["c: NCCL 2.27.3 differs from a (2.30.7)"],
        ),
        (  # NGC's containers of one torch version, from other commits
            [host_report(n, f"10.0.0.{i}/24", torch=torch)
             for i, (n, torch) in enumerate(zip(LABELS, ["2.8.0a0+5228986c39.nv25.06"] * 2
                                                 + ["2.8.0a0+34c6371d24.nv25.08"]), 1)],
            None,
            ["c: torch 2.8.0a0+34c6371d24.nv25.08 differs from a (2.8.0a0+5228986c39.nv25.06)"],
        ),
        (  # gloo on the CPU: one release's CPU-only and CUDA builds mix
            three_hosts(c=host_report("c", "10.0.0.3/24", torch="2.14.1+cpu", torchvision="0.29.1+cpu",
                                      cuda_runtime=None, cudnn=None, nccl=None, nccl_available=False)),
            None,
            [],
        ),
        (
            three_hosts(b=host_report("b", "10.0.0.2/24", python="3.12.1", torchvision=None)),
            None,
            ["b: python 3.12.1 differs from a (3.11.7)", "b: torchvision missing differs from a (0.29.1+cu130)"],
        ),
        (  # installed, but built for another torch: the reason, not just "missing"
            three_hosts(b=host_report("b", "10.0.0.2/24", torchvision=None, why_missing={
                "torchvision": "torchvision does not import: RuntimeError: operator "
                               "torchvision::nms does not exist"})),
            None,
            ["b: torchvision missing (torchvision does not import: RuntimeError: operator "
             "torchvision::nms does not exist) differs from a (0.29.1+cu130)"],
        ),
        (
            three_hosts(c=without_torch("c", "10.0.0.3/24")),
            None,
            ["c: torch does not import: ModuleNotFoundError: No module named 'torch' (interpreter /usr/bin/python3)"],
        ),
        (
            three_hosts(b={"error": "unreachable: ssh: connect to host b port 22: No route to host"}),
            None,
            ["b: unreachable: ssh: connect to host b port 22: No route to host"],
        ),
        (
            [host_report(n, f"10.0.0.{i}/24", gpus=gpus(k)) for i, (n, k) in enumerate(zip(LABELS, [8, 2, 8]), 1)],
            4,
            ["b: --nproc 4 but only 2 GPU(s) visible"],
        ),
        (  # sshd's limits, where a scheduler's jobs get unlimited: only where NCCL would use RDMA
            [host_report(n, f"10.0.0.{i}/24", gpus=gpus(1), rdma_devices=["mlx5_0"], locked_memory=limit, env=env)
             for i, (n, limit, env) in enumerate([("a", 8 * 2**20, {}), ("b", "unlimited", {}),
                                                  ("c", 65536, {"NCCL_IB_DISABLE": "1"})], 1)],
            None,
            ["a: ulimit -l is 8 MiB where RDMA (mlx5_0) needs pinned memory: NCCL over InfiniBand can fail "
             "to register its buffers; set memlock unlimited in /etc/security/limits.d/ (or NCCL_IB_DISABLE=1 "
             "for sockets)"],
        ),
        (  # one host: NCCL uses no RDMA within it
            [host_report("a", "10.0.0.1/24", gpus=gpus(8), rdma_devices=["mlx5_0"], locked_memory=65536)],
            None,
            [],
        ),
        (  # a GPU held by another process, in exclusive mode; one whose memory others hold
            [host_report(n, f"10.0.0.{i}/24", gpus=g) for i, (n, g) in enumerate(zip(LABELS, [
                gpus(4), gpus_with(4, error=f"RuntimeError: CUDA error: {BUSY}"), gpus_with(4, free_gib=3.2)]), 1)],
            None,
            [f"b: GPU 1 (NVIDIA H100) cannot be used: RuntimeError: CUDA error: {BUSY}",
             "c: GPU 1 (NVIDIA H100) has 3.2 GiB free of 79.1: other processes hold the rest (a job's, or one left "
             "from an earlier job? nvidia-smi)"],
        ),
        ([host_report(n, f"10.0.0.{i}/24", gpus=gpus_with(2, free_gib=40)) for i, n in enumerate(LABELS, 1)], None, []),
        (  # a GPU newer than any this torch was built for
            [host_report(n, f"10.0.0.{i}/24", torch="2.5.1+cu124", gpus=g) for i, (n, g) in enumerate(zip(
                LABELS, [gpus(1), gpus(1), [{"name": "NVIDIA GeForce RTX 5090", "memory_gib": 31.4,
                                             "capability": "12.0", "torch_has_kernels": False,
                                             "free_gib": 31.0}]]), 1)],
            None,
            ["c: torch 2.5.1+cu124 has no kernels for its NVIDIA GeForce RTX 5090 (cc 12.0): CUDA calls fail "
             'there ("no kernel image is available"); install a torch built for it'],
        ),
        (
            [host_report(n, f"10.0.0.{i}/24", gpus=gpus(k)) for i, (n, k) in enumerate(zip(LABELS, [1, 1, 0]), 1)],
            None,
            ["c: no GPU visible, but other hosts have GPUs (nccl and gloo do not mix)"],
        ),
        # Without GPUs the job runs on CPU, where any --nproc is fine.
        (three_hosts(), 16, []),
        (
            [host_report(n, f"10.0.0.{i}/24", torch="2.4.1+cu121") for i, n in enumerate(LABELS[:2], 1)],
            None,
            [f"{n}: torch 2.4.1+cu121 is older than 2.5: its torchrun sends workers to rank 0's "
             "host name, which every host must then resolve (upgrade torch)" for n in LABELS[:2]],
        ),
        # One host needs no rendezvous across the network, but still needs 2.8.
        (
            [host_report("a", "10.0.0.1/24", torch="2.7.1")],
            None,
            ["a: torch 2.7.1 is older than 2.8: a gloo rank can hang in destroy_process_group as the job "
             "ends (pytorch#154976; upgrade torch)"],
        ),
        (
            three_hosts(
                b=host_report("b", "10.0.0.2/24", env={"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth"}),
                c=host_report("c", "10.0.0.3/24", env={"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "et,ib"}),
            ),
            None,
            ["b: GLOO_SOCKET_IFNAME=eth1, but it has no interface eth1 (only eth0, lo)",
             "b: NCCL_SOCKET_IFNAME==eth matches none of its interfaces (eth0, lo)"],
        ),
        (three_hosts(b=host_report("b", "10.0.0.2/24", env={"NCCL_SOCKET_IFNAME": "^docker,lo"})), None, []),
        (
            three_hosts(b=host_report("b", "10.0.0.2/24", env={"NCCL_SOCKET_IFNAME": "ib,,ens"}),
                        c=host_report("c", "10.0.0.3/24", env={"NCCL_SOCKET_IFNAME": "=eth0:1"})),
            None,
            ["b: NCCL_SOCKET_IFNAME=ib,,ens matches none of its interfaces (eth0, lo)"],  # an empty item matches none
        ),
        # PyPI's wheel and download.pytorch.org's of one release: the CUDA and NCCL rows compare builds.
        (three_hosts(b=host_report("b", "10.0.0.2/24", torch="2.14.1", torchvision="0.29.1")), None, []),
        # The hang at exit is gloo's: a GPU job runs on nccl.
        ([host_report("a", "10.0.0.1/24", torch="2.7.1", gpus=gpus(1))], None, []),
        # Each offset from this machine's clock is known within the time its report took.
        (
            three_hosts(b=host_report("b", "10.0.0.2/24", clock_offset=[-41.0, -39.0]),
                        c=host_report("c", "10.0.0.3/24", clock_offset=[3.0, 8.0])),  # maybe 3.2 s: fine
            None,
            ["b: its clock is about 40 s behind a's, and torchrun's rendezvous, which compares the hosts' "
             "clocks, drops a host at 15 s off or less: sync them (NTP: chrony, systemd-timesyncd)"],
        ),
        # The first host's clock is the odd one: it is named, not the two that agree.
        (
            [host_report("a", "10.0.0.1/24", clock_offset=[-41.0, -39.0]), *three_hosts()[1:]],
            None,
            ["a: its clock is about 40 s behind b's, and torchrun's rendezvous, which compares the hosts' "
             "clocks, drops a host at 15 s off or less: sync them (NTP: chrony, systemd-timesyncd)"],
        ),
        (
            three_hosts(c=host_report("c", "10.0.0.3/24", clock_offset=[4.2, 5.2])),
            None,
            ["c: its clock is about 5 s ahead of a's, and torchrun's rendezvous, which compares the hosts' "
             "clocks, drops a host at 15 s off or less: sync them (NTP: chrony, systemd-timesyncd)"],
        ),
        # Neither is 4 s from a's for certain, but they are from each other.
        (
            three_hosts(b=host_report("b", "10.0.0.2/24", clock_offset=[2.5, 3.5]),
                        c=host_report("c", "10.0.0.3/24", clock_offset=[-3.5, -2.5])),
            None,
            ["b: its clock is about 6 s ahead of c's, and torchrun's rendezvous, which compares the hosts' "
             "clocks, drops a host at 15 s off or less: sync them (NTP: chrony, systemd-timesyncd)"],
        ),
    ],
    ids=[
        "match",
        "torch",
        "torch-first-host",
        "nccl",
        "torch-ngc-builds",
        "cpu-only-build-on-cpus",
        "python-torchvision",
        "torchvision-broken",
        "no-torch",
        "unreachable",
        "nproc-gpus",
        "rdma-locked-memory",
        "rdma-one-host",
        "gpus-taken",
        "gpus-half-free",
        "gpu-without-kernels",
        "gpu-cpu-mix",
        "cpu-nproc",
        "old-torch",
        "old-torch-one-host",
        "interface-names",
        "nccl-exclusions",
        "nccl-empty-items-and-ports",
        "build-label",
        "old-torch-gpus",
        "clock-behind",
        "clock-first-host",
        "clock-ahead",
        "clocks-apart",
    ],
)
def test_find_problems(reports, nproc, expected):
    assert check_env.find_problems(LABELS[: len(reports)], reports, nproc) == expected


def test_unreachable_first_host_compares_against_the_next():
    reports = three_hosts(c=host_report("c", "10.0.0.3/24", torch="2.13.0"))
    reports[0] = {"error": "unreachable: timeout"}
    assert check_env.find_problems(LABELS, reports) == [
        "a: unreachable: timeout",
        "c: torch 2.13.0 differs from b (2.14.1+cu130)",
    ]


def hosts(*entries):
    """Host objects as read_hosts makes them; "localhost" is this machine."""
    return [check_env.Host(e, None, e, None, e == "localhost") for e in entries]


def test_job_addresses_are_where_ssh_reached_each_host_even_without_a_shared_subnet():
    # A routed cluster: a /32 per host, no subnet in common, every host reachable.
    reports = [host_report(n, f"10.1.{i}.7/32") for i, n in enumerate(LABELS)]
    assert check_env.find_problems(LABELS, reports) == []
    assert check_env.job_addresses(hosts(*LABELS), reports) == (["10.1.0.7", "10.1.1.7", "10.1.2.7"], [])


def test_this_machine_is_where_the_remote_hosts_saw_it_connect_from(monkeypatch):
    monkeypatch.setattr(check_env, "holds_address", lambda address: address == "10.0.0.100")
    local = host_report("here", "10.0.0.100/24", ssh_connection="192.0.2.1 40000 203.0.113.5 22")  # our own login
    reports = [local, host_report("b", "10.0.0.2/24")]
    assert check_env.job_addresses(hosts("localhost", "b"), reports) == (["10.0.0.100", "10.0.0.2"], [])
    assert check_env.job_addresses(hosts("localhost"), [local]) == (["127.0.0.1"], [])


def test_holds_address_knows_this_machines_addresses():
    assert check_env.holds_address("127.0.0.1") and check_env.holds_address("::ffff:127.0.0.1")
    assert not check_env.holds_address("192.0.2.1")  # TEST-NET-1: nobody's


def test_this_machine_behind_nat_or_a_jump_host_is_a_problem(monkeypatch):
    monkeypatch.setattr(check_env, "holds_address", lambda address: False)
    local = host_report("here", "192.168.1.5/24")  # the hosts see 10.0.0.100 connect
    _, problems = check_env.job_addresses(hosts("localhost", "b"), [local, host_report("b", "10.0.0.2/24")])
    assert problems == [
        "localhost: the other hosts see this machine as 10.0.0.100, which it does not hold "
        "(NAT or a jump host?): they cannot reach it there"
    ]


def test_addresses_other_hosts_cannot_use_are_problems():
    reports = [
        host_report("a", "10.0.0.1/24"),
        host_report("b", "10.0.0.2/24", ssh_connection="127.0.0.1 40000 127.0.0.1 2222"),
        host_report("c", "10.0.0.3/24", ssh_connection="10.0.0.100 40001 10.0.0.1 2022"),
        host_report("d", "10.0.0.4/24", ssh_connection=None),
        {"error": "unreachable: timeout"},
    ]
    _, problems = check_env.job_addresses(hosts("a", "b", "c", "d", "e"), reports)
    assert problems == [
        "b: reached at 127.0.0.1 (a tunnel?): list it by an address the other hosts can reach",
        "c: reached at 10.0.0.1, as a is (one machine under two names? containers behind one address?): "
        "every host needs its own address",
        "d: its sshd sets no SSH_CONNECTION, so its address is unknown",
    ]


def test_one_host_reached_through_a_tunnel_is_fine():
    """No other host needs to reach it there."""
    report = host_report("b", "10.0.0.2/24", ssh_connection="127.0.0.1 40000 127.0.0.1 2222")
    assert check_env.job_addresses(hosts("b"), [report]) == (["127.0.0.1"], [])


def check_hosts_with(monkeypatch, capsys, tmp_path, reports, *args):
    """Run main(--hosts ...) on synthetic reports instead of real hosts."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("a\nb\nc\n")
    monkeypatch.setattr(check_env, "fetch_reports", lambda hosts, python: reports)
    status = check_env.main(["--hosts", str(hostfile), *args])
    return status, capsys.readouterr().out


def test_matching_hosts_exit_0(monkeypatch, capsys, tmp_path):
    status, out = check_hosts_with(monkeypatch, capsys, tmp_path, three_hosts())
    assert status == 0
    assert "OK: all 3 host(s) match" in out


def test_mismatch_exits_1_with_one_line_per_problem_and_marks_the_table(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("COLUMNS", "200")  # wide enough for hosts as columns
    reports = three_hosts(b=host_report("b", "10.0.0.2/24", torch="2.13.0"), c=without_torch("c", "10.0.0.3/24"))
    status, out = check_hosts_with(monkeypatch, capsys, tmp_path, reports)
    assert status == 1
    assert "2 problem(s):\nb: torch 2.13.0 differs from a (2.14.1+cu130)\nc: torch does not import" in out
    table = out.splitlines()
    header = table[0].split()
    assert header == ["a", "b", "c"]
    assert any(line.startswith("* torch ") for line in table)
    assert any(line.startswith("  hostname ") for line in table)  # differs by nature: not marked


def test_table_too_wide_for_the_terminal_groups_hosts_by_value(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    labels = [f"node{i}" for i in range(6)]
    reports = [host_report(label, f"10.0.0.{i}/24") for i, label in enumerate(labels)]
    reports[2]["torch"] = reports[4]["torch"] = "2.13.0"
    reports[3]["env"] = {"NCCL_DEBUG": "INFO", "GLOO_SOCKET_IFNAME": "eth0"}
    reports[5] = {"error": "unreachable: ssh: connect to host node5 port 22: timed out"}
    table = check_env.format_table(labels, reports).splitlines()
    assert max(len(line) for line in table) <= 100
    assert table[0] == "6 hosts: node0, node1, node2, node3, node4, node5"
    assert table.index("* torch         node2, node4: 2.13.0") + 1 == table.index(
        "                the other 3: 2.14.1+cu130")
    assert "  python        3.11.7" in table  # the same everywhere: said once
    assert "  status        node5: error: unreachable: ssh: connect to host node5 port 22: timed out" in table
    assert "                the other 5: ok" in table
    env_row = table.index("* env           node3: NCCL_DEBUG=INFO")
    assert table[env_row + 1:env_row + 3] == [
        "                  GLOO_SOCKET_IFNAME=eth0", "                the other 4: (none set)"]
    hostname_row = table.index("  hostname      node0: node0")  # each its own: every host named
    assert table[hostname_row + 4] == "                node4: node4"
    unreachable = [{"error": f"unreachable: ssh: connect to host {label} port 22: timed out"} for label in labels]
    table = check_env.format_table(labels, unreachable).splitlines()
    assert len(table) == 2 + 6 and all(": error: unreachable" in line for line in table[2:])  # no rows of "-"


def test_json_output_has_reports_and_problems(monkeypatch, capsys, tmp_path):
    reports = three_hosts(c=host_report("c", "10.0.0.3/24", torch="2.13.0+cu130"))
    status, out = check_hosts_with(monkeypatch, capsys, tmp_path, reports, "--json")
    assert status == 1
    data = json.loads(out)
    assert list(data["hosts"]) == LABELS
    assert data["problems"] == ["c: torch 2.13.0+cu130 differs from a (2.14.1+cu130)"]


# --------------------------------------------------------------------------
# hosts.txt and the SSH command line
# --------------------------------------------------------------------------


def test_read_hosts_accepts_the_documented_format(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(  # after a byte-order mark, as some Windows editors write
        "\ufeff# the first host serves the rendezvous\nlocalhost\n\n  gpu-01.example.org  # comment\nme@10.0.0.2:2222\n"
    )
    hosts = check_env.read_hosts(hostfile)
    assert [(h.entry, h.user, h.name, h.port, h.is_local) for h in hosts] == [
        ("localhost", None, "localhost", None, True),
        ("gpu-01.example.org", None, "gpu-01.example.org", None, False),
        ("me@10.0.0.2:2222", "me", "10.0.0.2", "2222", False),
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ("node1\nnode2; touch /tmp/pwned\n", "invalid host 'node2; touch /tmp/pwned'"),
        ("$(reboot)\n", "invalid host '$(reboot)'"),
        ("`id`\n", "invalid host '`id`'"),
        ("-oProxyCommand=sh\n", "invalid host '-oProxyCommand=sh'"),
        ("node1:99999\n", "invalid host 'node1:99999'"),
        ("node1 slots=8\n", "[user@]host[:port] (DeepSpeed's and MPI's slots=N has no place here: --nproc"),
        ("node1\nNODE1\n", "duplicate host 'NODE1' (also on line 1)"),
        ("localhost\n127.0.0.1\n", "duplicate host '127.0.0.1' (this machine, also on line 1)"),
        ("localhost\nLOCALHOST\n", "duplicate host 'LOCALHOST' (this machine, also on line 1)"),
        ("# only a comment\n\n", "no hosts listed"),
    ],
)
def test_bad_hosts_file_is_one_line_and_exit_2_before_anything_runs(monkeypatch, capsys, tmp_path, content, message):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(content)
    monkeypatch.setattr(check_env, "fetch_reports", lambda *a: pytest.fail("contacted hosts despite a bad hosts file"))
    assert check_env.main(["--hosts", str(hostfile)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_hosts_that_keep_it_waiting_are_named(monkeypatch, capsys):
    monkeypatch.setattr(check_env, "PATIENCE_S", 0.2)
    hosts = [check_env.Host(name, None, name, None, False) for name in ("a", "b", "c")]
    slow = {"b", "c"}
    results = check_env.on_every_host(hosts, lambda host: time.sleep(1 if host.entry in slow else 0) or host.entry)
    assert results == ["a", "b", "c"]
    assert capsys.readouterr().err == "check_env.py: still waiting for b, c after 0.2 s (giving up at 90 s)\n"


def test_missing_or_undecodable_hosts_file_is_exit_2(capsys, tmp_path):
    assert check_env.main(["--hosts", str(tmp_path / "nope.txt")]) == 2
    assert "cannot read hosts file" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("h\xe9te\n".encode("latin-1"))  # not UTF-8
    assert check_env.main(["--hosts", str(latin1)]) == 2
    err = capsys.readouterr().err
    assert f"cannot read hosts file {latin1}: 'utf-8' codec can't decode byte 0xe9" in err
    assert err.count("\n") == 1


def test_ssh_command_honours_SSH_COMMAND_and_quotes_the_remote_command(monkeypatch):
    monkeypatch.setenv("SSH_COMMAND", "ssh -F ./cluster_ssh_config")
    monkeypatch.setenv("NCCL_SECRET", "s3cret")
    host = check_env.Host("me@node2:2222", "me", "node2", "2222", False)
    python = "/opt/my python/bin/python"
    argv = check_env.host_command(host, [python, "-", "--json"], python)
    assert argv == [
        "ssh", "-F", "./cluster_ssh_config", "-T", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
        "-o", "RemoteCommand=none", "-o", "ClearAllForwardings=yes", "-o", "LogLevel=INFO", "-p", "2222",
        "--", "me@node2",
        f"exec '{python}' -c '{check_env.FORWARD_ENV_CODE}' '{python}' - --json",
    ]  # fmt: skip
    # The variables go on stdin, and FORWARD_ENV sets them for the command.
    assert json.loads(check_env.forwarded_input(host))["NCCL_SECRET"] == "s3cret"
    assert "s3cret" not in " ".join(argv)
    command = [sys.executable, "-c", check_env.FORWARD_ENV_CODE, "sh", "-c", 'echo "$NCCL_SECRET"; cat']
    forwarding = subprocess.run(command, input=check_env.forwarded_input(host) + b"then the command's input",
                                capture_output=True, timeout=30)
    assert forwarding.stdout == b"s3cret\nthen the command's input"
    assert check_env.host_command(LOCALHOST, ["python", "-"], "python") == ["python", "-"]
    assert check_env.forwarded_input(LOCALHOST) == b""  # it inherits them


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_SSH_COMMAND_is_ssh(monkeypatch, value):
    """As launch.sh and setup_ssh.sh take it: a wrapper may export it empty."""
    monkeypatch.setenv("SSH_COMMAND", value)
    host = check_env.Host("node2", None, "node2", None, False)
    assert check_env.host_command(host, ["python", "-"], "python")[:2] == ["ssh", "-T"]


def test_an_ssh_that_fails_without_a_word_says_so():
    """As with ssh -q in SSH_COMMAND: not an "unreachable: " that ends there."""
    host = check_env.Host("node2", None, "node2", None, False)
    assert check_env.failure(host, "python3", 255, "") == "unreachable: ssh said nothing"


def test_missing_interpreter_is_a_problem_not_a_crash(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    result = run_check_env(["--hosts", str(hostfile), "--python", str(tmp_path / "no-python")], timeout=30)
    assert result.returncode == 1
    assert f"localhost: cannot run {tmp_path / 'no-python'}: not found" in result.stdout


def test_too_old_interpreter_is_named_not_a_traceback(tmp_path):
    # Python 3.8 as Ubuntu 20.04's python3, where the report would crash on `str | None`.
    old_python = tmp_path / "python3.8"
    old_python.write_text(
        f"#!/bin/sh\nexec {sys.executable} -c 'import sys; sys.version_info = (3, 8, 18); "
        "sys.argv.pop(0); exec(sys.stdin.read())' \"$@\"\n")  # argv as `python - ARGS` has it
    old_python.chmod(0o755)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    result = run_check_env(["--hosts", str(hostfile), "--python", str(old_python)], timeout=30)
    assert result.returncode == 1
    assert (f"localhost: {old_python} failed with exit status 1: check_env.py needs Python 3.10 "
            "or newer, and this is 3.8.18") in result.stdout


# --------------------------------------------------------------------------
# All-reduce
# --------------------------------------------------------------------------


def node(*argv):
    """argv as run_allreduce runs each node's torchrun: through check_env.py --run-node."""
    return [sys.executable, str(REPO / "check_env.py"), "--run-node", *argv]


def test_run_nodes_stops_the_others_when_one_fails(tmp_path):
    pid_file = tmp_path / "sleep.pid"
    start = time.monotonic()
    outputs, failed, hung = check_env.run_nodes(
        [LOCALHOST, LOCALHOST],
        [
            node("sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"),
            # Fails once the other node has started its sleep.
            node("sh", "-c", f"while [ ! -s {pid_file} ]; do sleep 0.1; done; echo boom >&2; exit 3"),
        ],
        sys.executable,
    )
    assert failed == 1 and not hung and outputs[1] == "boom\n"  # stderr too
    assert time.monotonic() - start < 10
    # The whole group goes, not only its leader: the background sleep too.
    assert not is_running(int(pid_file.read_text()))


def test_run_nodes_stops_everything_at_the_deadline(monkeypatch):
    monkeypatch.setattr(check_env, "ALLREDUCE_DEADLINE_S", 1)
    start = time.monotonic()
    outputs, failed, hung = check_env.run_nodes([LOCALHOST], [node("sleep", "60")], sys.executable)
    assert failed is None and hung
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("stop", ["end_of_stdin", "SIGTERM"])
def test_a_stopped_node_kills_what_ignores_sigterm_after_5_s(stop):
    proc = subprocess.Popen(
        node("sh", "-c", "trap '' TERM; sleep 60 & echo $!; wait"), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    sleep_pid = None
    try:
        sleep_pid = int(proc.stdout.readline())
        start = time.monotonic()
        if stop == "end_of_stdin":
            proc.stdin.close()  # as when check_env.py, or the ssh between, is killed
        else:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 128 + signal.SIGKILL
        assert 4 < time.monotonic() - start < 10
        assert not is_running(sleep_pid)
    finally:
        proc.kill()
        proc.wait()
        if sleep_pid is not None:  # and the shell's group, which the node left behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(sleep_pid), signal.SIGKILL)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_hosts_report_ends_their_commands_at_once(tmp_path, stop_signal):
    """A host whose report takes long (a cold `import torch`, here a sleep that writes its
    pid) does not hold check_env.py up for REPORT_TIMEOUT_S (90 s)."""
    slow_python = tmp_path / "python"
    slow_python.write_text(f"#!/bin/sh\nsleep 60 & echo $! > {tmp_path}/pid\nwait\n")
    slow_python.chmod(0o755)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    pid_file = tmp_path / "pid"
    proc = subprocess.Popen([sys.executable, REPO / "check_env.py", "--hosts", hostfile, "--python", slow_python],
                            stdout=subprocess.DEVNULL)
    try:
        while not pid_file.exists() or not pid_file.read_text().endswith("\n"):
            assert proc.poll() is None
            time.sleep(0.1)
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=10) == 128 + stop_signal
        assert not is_running(int(pid_file.read_text()))
    finally:
        proc.kill()
        proc.wait()
        kill_the_pid_in(pid_file)


def test_a_command_that_reads_its_input_late_gets_all_of_it():
    """More than a pipe holds (check_env.py itself, sent to each host), to a reader that
    starts after the first of the 1 s waits (an ssh login through a bastion, say)."""
    status = check_env.run_on_host(LOCALHOST, ["sh", "-c", "sleep 2; wc -c"], sys.executable, stdin=b"x" * 100_000,
                                   timeout=10)
    assert status == (0, "100000\n", "")


@pytest.mark.parametrize("end", ["timeout", "signal"])
def test_a_host_given_up_on_is_not_waited_for_where_a_control_master_holds_its_output(
    tmp_path, monkeypatch, end
):
    """An ssh that shares a ControlMaster's connection hands its output to the master, which
    holds it open until the remote command ends (never, on a hung mount). Here a process out
    of reach of the kill, in a session of its own, holds it."""
    holder = tmp_path / "report"
    holder.write_text(f"#!/bin/sh\nsetsid sleep 60 & echo $! > {tmp_path}/pid\nsleep 60\n")
    holder.chmod(0o755)
    monkeypatch.setattr(check_env, "STOPPING", threading.Event())
    stopper = threading.Timer(2, check_env.STOPPING.set)  # as stop_at_signal does
    if end == "signal":
        stopper.start()
    start = time.monotonic()
    try:
        status = check_env.run_on_host(LOCALHOST, [str(holder)], sys.executable, timeout=3 if end == "timeout" else 30)
        assert status == (None, "", "no answer within 3 s" if end == "timeout" else "stopped")
        assert time.monotonic() - start < 10
    finally:
        stopper.cancel()
        pid_file = tmp_path / "pid"
        kill_the_pid_in(pid_file)


def test_a_worker_ends_when_torchrun_its_parent_is_gone():
    # A parent that starts the watch in a child, prints the child's pid and exits after 2 s.
    watch = (
        f"import os, sys; sys.path.insert(0, {str(REPO)!r}); import check_env; "
        "check_env.exit_when_orphaned(os.getppid())"
    )
    parent = subprocess.run(
        ["sh", "-c", f'"$0" -c "$1" >/dev/null 2>&1 & echo $!; sleep 2', sys.executable, watch],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    child = int(parent.stdout)
    deadline = time.monotonic() + 5
    try:
        while is_running(child):
            assert time.monotonic() < deadline, "the orphaned child is still running"
            time.sleep(0.1)
    finally:
        if is_running(child):
            os.kill(child, signal.SIGKILL)


def kill_the_pid_in(pid_file):
    """SIGKILL the process whose pid a test's command wrote to pid_file, if it is still running."""
    if pid_file.exists() and is_running(int(pid_file.read_text())):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def is_running(pid):
    """Whether pid exists and is not a zombie waiting for its new parent to reap it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


ALLREDUCE_SIZES = ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB"]


def test_allreduce_on_this_machine_with_two_processes():
    result = run_check_env(["--nproc", "2", "--allreduce"], timeout=180)  # no --hosts: localhost
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all-reduce, float32 sum, gloo, 1 node(s), 2 ranks" in result.stdout
    rows = allreduce_rows(result.stdout)
    assert [" ".join(row[:2]) for row in rows] == ALLREDUCE_SIZES
    for row in rows:
        assert row[5] == "ok"  # the sum was right
        time_us, algbw, busbw = map(float, row[2:5])
        assert time_us > 0 and busbw == pytest.approx(algbw * 2 * (2 - 1) / 2, abs=0.002)


def test_allreduce_of_one_process_is_refused():
    """Its bandwidth would be a copy's, and its busbw 0."""
    result = run_check_env(["--nproc", "1", "--allreduce"], timeout=60)
    assert (result.returncode, result.stdout) == (2, ""), result.stdout + result.stderr  # no table first
    # (Its own report may take 10 s on a loaded machine, and check_env.py then says it waits.)
    stderr = re.sub(r"check_env.py: still waiting for .*\n", "", result.stderr)
    assert stderr == ("check_env.py: --allreduce needs 2 processes or more, and this is 1 host x 1 "
                      "process: add hosts, or --nproc 2\n")


def allreduce_rows(stdout):
    """The benchmark's table rows, split: size, unit, time, algbw, busbw, check."""
    return [line.split() for line in stdout.splitlines() if re.match(r" *\d+ [KM]iB ", line)]


def test_allreduce_says_so_when_check_env_is_not_on_every_host(monkeypatch, tmp_path):
    # As if this copy of check_env.py lived where the hosts cannot see it.
    absent = tmp_path / "elsewhere" / "check_env.py"
    monkeypatch.setattr(check_env, "__file__", str(absent))
    status, message = check_env.run_allreduce(
        [LOCALHOST], [host_report("a", "10.0.0.1/24")], ["127.0.0.1"], sys.executable, 1
    )
    assert status == 1
    assert (
        "must be at that path on every host (a shared filesystem or the same image); it is not on: localhost" in message
    )
    assert str(absent) in message


def test_an_allreduce_error_is_shown_without_torchs_rank_prefix():
    # A worker's exception after init_process_group, as torch's excepthook prints it.
    output = """[rank1]: Traceback (most recent call last):
[rank1]:   File "/opt/check_env.py", line 1010, in allreduce_worker
[rank1]:     dist.all_reduce(x)
[rank1]: torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3401, unhandled system error
[rank1]: ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.
[rank1]: Last error:
[rank1]: NET/IB : Unable to register memory
  exitcode  : 1 (pid: 4242)
"""
    hosts = [check_env.Host(name, None, name, None, False) for name in ("node1", "node2")]
    assert check_env.explain_node_failure(hosts, 1, ["", output], "10.0.0.1:29500") == (
        "node2: the all-reduce failed\n"
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3401, unhandled system error\n"
        "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.\n"
        "Last error: NET/IB : Unable to register memory\n"
        "exitcode  : 1 (pid: 4242)")


def test_a_worker_killed_in_the_allreduce_is_explained_by_its_signal():
    # The end of torchrun's output where a worker got a SIGKILL: its exception has no text.
    output = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
check_env.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-05_19:40:02
  host      : node2
  rank      : 1 (local_rank: 0)
  exitcode  : -9 (pid: 4242)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================
"""
    hosts = [check_env.Host(name, None, name, None, False) for name in ("node1", "node2")]
    assert check_env.explain_node_failure(hosts, 1, ["", output], "10.0.0.1:29500") == (
        "node2: the all-reduce failed\n"
        "exitcode  : -9 (pid: 4242)\n"
        "traceback : Signal 9 (SIGKILL) received by PID 4242")
