"""check_env.py without a cluster: the local report and its GPU, gloo, compiler and AMP rows,
the comparison of synthetic reports, the commands it runs (ssh, srun through a fake, torchrun,
launch.sh), and a real all-reduce between two processes here."""

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from conftest import REPO, run

sys.path.insert(0, str(REPO))
import check_env  # noqa: E402


def run_check_env(args, timeout, env=None, **kwargs):
    return run([sys.executable, REPO / "check_env.py", *args], timeout=timeout, env=env or {}, **kwargs)


# --------------------------------------------------------------------------
# The local report
# --------------------------------------------------------------------------

def test_local_report_as_indented_json_and_as_text(monkeypatch, capsys):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert check_env.main(["--json"]) == 0
    out = capsys.readouterr().out
    assert out.startswith('{\n  "hostname": ')  # indented: a newcomer reads it
    report = json.loads(out)
    assert report["python_executable"] == sys.executable and report["torch"] == torch.__version__
    assert report["gloo_available"] is True and len(report["gpus"]) == torch.cuda.device_count()
    assert {"NCCL_DEBUG": "INFO", "MASTER_PORT": "1234"}.items() <= report["env"].items()
    assert {"name": "lo", "address": "127.0.0.1/8"} in report["interfaces"]
    assert report["clock"][0] <= report["clock"][1] <= time.time()
    # Every row's value that could not be had comes with a reason.
    assert all(key in report["why_missing"] for _, key, *_ in check_env.ROWS if report[key] is None)
    assert check_env.main([]) == 0
    text = capsys.readouterr().out
    for label, *_ in check_env.ROWS:
        assert re.search(rf"^{label} +\S", text, re.M), label


def test_report_without_torch_says_missing(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    report = check_env.gather_report()
    assert report["torch"] is None and report["gpus"] == []
    assert "missing (no torch)" in check_env.format_report(report)
    [problem] = check_env.find_problems(["a"], [report])
    assert problem.startswith("a: torch does not import: ModuleNotFoundError: ")
    assert problem.endswith(f" (interpreter {sys.executable})")


def fake_gpu(monkeypatch, capability, arch_list, name="Tesla V100-SXM2-32GB"):
    """One GPU of capability, in a torch built for arch_list."""
    props = SimpleNamespace(name=name, total_memory=32 * 2**30, major=capability[0], minor=capability[1])
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (31 * 2**30, 32 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: arch_list)


def test_a_gpu_without_kernels_in_this_torch_is_named_with_what_torch_was_built_for(monkeypatch):
    fake_gpu(monkeypatch, (7, 0), ["sm_75", "sm_80", "compute_80"])  # a V100 under CUDA 13's torch
    report = check_env.gather_report()
    assert report["gpus"][0]["torch_has_kernels"] is False
    assert "Tesla V100-SXM2-32GB, 32.0 GiB, cc 7.0, no kernels in this torch" in check_env.format_report(report)
    assert check_env.find_problems(["gpu-03"], [report]) == [
        f"gpu-03: torch {torch.__version__}, built for sm_75 sm_80 compute_80, has no kernels for its "
        "Tesla V100-SXM2-32GB (cc 7.0): install a torch built for sm_70"]


@pytest.mark.parametrize("capability, arch_list, has_kernels", [
    ((9, 0), ["sm_75", "sm_80", "sm_86", "sm_90"], True),
    ((8, 9), ["sm_75", "sm_80", "sm_86", "sm_90"], True),  # an sm_89 runs sm_86's machine code
    ((8, 0), ["sm_75", "sm_86", "sm_90"], False),  # but an sm_80 does not
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
    return SimpleNamespace(__version__="2.x", version=SimpleNamespace(cuda=cuda, hip=None),
                           cuda=SimpleNamespace(init=init))


NO_DRIVER = RuntimeError("Found no NVIDIA driver on your system.")
DRIVER_FIX = ": a driver too old for CUDA 13.0, or updated without a reboot? (nvidia-smi tells)"


@pytest.mark.parametrize("device, visible, torch_, why", [
    ("nvidia0", None, fake_torch(init_error=NO_DRIVER),
     "{dev}/nvidia0 is here, but RuntimeError: Found no NVIDIA driver on your system." + DRIVER_FIX),
    ("nvidia0", "3", fake_torch(init_error=RuntimeError("No CUDA GPUs are available")),
     "{dev}/nvidia0 is here, but RuntimeError: No CUDA GPUs are available (CUDA_VISIBLE_DEVICES=3)" + DRIVER_FIX),
    ("nvidia0", None, fake_torch(cuda=None), "{dev}/nvidia0 is here, but torch 2.x is a CPU-only build: install a "
                                             "CUDA build"),
    ("nvidia0", "", fake_torch(init_error=NO_DRIVER), None),  # hidden on purpose
    ("nvidia0", "-1", fake_torch(init_error=NO_DRIVER), None),
    ("denied", None, fake_torch(init_error=NO_DRIVER), None),  # a scheduler's job given no GPU: a cgroup denies it
    ("nvidiactl", None, fake_torch(init_error=NO_DRIVER), None),  # no GPU's device file
], ids=["driver", "visible_devices", "cpu_build", "hidden", "hidden_-1", "denied", "none"])
def test_gpus_that_torch_cannot_see_are_named(tmp_path, monkeypatch, device, visible, torch_, why):
    """torch counts 0 GPUs, and raises nothing, where the driver fails: it only warns."""
    if device == "denied":  # as open() fails for it
        (tmp_path / "nvidia0").symlink_to(tmp_path / "gone")
    else:
        (tmp_path / device).touch()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    if visible is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert check_env.gpus_torch_cannot_use(torch_, dev=tmp_path) == (why and why.format(dev=tmp_path))


def test_gpus_that_cuda_cannot_use_are_a_problem_not_a_crash(monkeypatch):
    def too_old(*args):
        raise RuntimeError("The NVIDIA driver on your system is too old")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # NVML counts them
    monkeypatch.setattr(torch.cuda, "get_device_properties", too_old)
    report = check_env.gather_report()
    assert report["gpus"] == [] and "too old" in report["why_missing"]["gpus"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # where torch only warns
    monkeypatch.setattr(check_env, "gpus_torch_cannot_use", lambda torch: "/dev/nvidia0 is here, but (why)")
    assert check_env.find_problems(["a", "b"], [report, check_env.gather_report()])[:2] == [
        "a: CUDA cannot use the GPUs: RuntimeError: The NVIDIA driver on your system is too old",
        "b: CUDA cannot use the GPUs: /dev/nvidia0 is here, but (why)"]


@pytest.mark.parametrize("gpus, amp", [
    ([], "bf16 (fp16 is many times slower than fp32 on a CPU)"),
    (["7.5"], "fp16 (bf16 is emulated and slow before Ampere: cc 7.5)"),
    (["8.0"], "bf16, fp16"),
])
def test_amp_row_names_the_one_faster_than_fp32(gpus, amp):
    report = host_report("a", "10.0.0.1/24", gpus=[{**GPU, "capability": c} for c in gpus])
    assert f"\nAMP           {amp}\n" in check_env.format_report(report)


@pytest.mark.parametrize("gloo_socket_ifname, shown", [
    (None, "{address} (loopback: set GLOO_SOCKET_IFNAME, as launch.sh does)"),
    ("", "{address} (loopback: set GLOO_SOCKET_IFNAME, as launch.sh does)"),
    ("e", "{address} (loopback: set GLOO_SOCKET_IFNAME, as launch.sh does)"),
    ("eth0", "GLOO_SOCKET_IFNAME=eth0"),
])
def test_gloo_on_a_name_that_resolves_to_loopback_is_shown_with_its_fix(monkeypatch, gloo_socket_ifname, shown):
    """gloo listens where the host's name resolves without GLOO_SOCKET_IFNAME (of 2 characters
    or more: torch ignores a shorter one), which Debian maps to 127.0.1.1."""
    monkeypatch.setattr(check_env.socket, "gethostname", lambda: "localhost")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert check_env.show_gloo(host_report("a", "10.0.0.1/24", gloo_address="10.0.0.1")) == "10.0.0.1"
    if gloo_socket_ifname is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", gloo_socket_ifname)
    report = check_env.gather_report()
    assert report["gloo_address"] in ("127.0.0.1", "::1")
    assert f"\ngloo address  {shown.format(address=report['gloo_address'])}\n" in check_env.format_report(report)


@pytest.mark.parametrize("gpus, variable, wanted", [([], "CXX", "g++"), ([{"name": "H100"}], "CC", "gcc or clang")])
def test_a_missing_compiler_for_compile_is_shown(monkeypatch, tmp_path, gpus, variable, wanted):
    """torch.compile needs a C++ compiler on CPUs (CXX, else g++), Triton's C one on GPUs."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-compiler"))
    assert check_env.gather_report()["compiler"] is None
    monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # finds none
    why = {}
    assert check_env.find_compiler(gpus, why) is None
    assert why["compiler"] == f"no {wanted}: train.py --compile needs one"
    (tmp_path / wanted.split()[0]).touch(mode=0o755)
    assert check_env.find_compiler(gpus, why) == str(tmp_path / wanted.split()[0])


# --------------------------------------------------------------------------
# Comparing synthetic reports
# --------------------------------------------------------------------------

BASE = {
    "hostname": "a", "os": "Linux", "python": "3.11.7", "python_executable": "/opt/py/bin/python",
    "torch": "2.14.1+cu130", "torchvision": "0.29.1+cu130", "cuda_runtime": "13.0", "cudnn": "9.24.0",
    "nccl": "2.30.7", "gloo_available": True, "nccl_available": True, "arch_list": ["sm_80", "sm_90"],
    "gpus": [], "driver": None, "compiler": "/usr/bin/g++", "gloo_address": "10.0.0.1",
    "interfaces": [{"name": "lo", "address": "127.0.0.1/8"}, {"name": "eth0", "address": "10.0.0.1/24"}],
    "rdma_devices": [], "env": {}, "ssh_connection": None,
    "why_missing": {"driver": "no NVIDIA driver loaded"},
    "clock": [1796400000.0, 1796400001.5],
    "clock_offset": [-0.2, 0.1],  # from this machine's, as parse_report finds it
}  # fmt: skip
GPU = {"name": "NVIDIA H100", "memory_gib": 79.1, "capability": "9.0", "torch_has_kernels": True, "free_gib": 78.6}


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


def gpus(n, **second):
    """n GPUs, the second with the values given."""
    return [GPU if i != 1 else {**GPU, **second} for i in range(n)]


LABELS = ["a", "b", "c"]
BUSY = "CUDA-capable device(s) is/are busy or unavailable"  # (CUDA's words)
CLOCK = "'s, and torchrun's rendezvous drops a host at 15 s off: sync them (NTP: chrony)"


def three_hosts(b=None, c=None, **changes):
    """Three matching hosts, with b and c replaced where given."""
    return [host_report("a", "10.0.0.1/24", **changes), b or host_report("b", "10.0.0.2/24", **changes),
            c or host_report("c", "10.0.0.3/24", **changes)]


@pytest.mark.parametrize("reports, nproc, expected", [
    (three_hosts(), None, []),
    (three_hosts(b=host_report("b", "10.0.0.2/24", torch="2.13.0+cu130")), None,
     ["b: torch 2.13.0+cu130 differs from a (2.14.1+cu130)"]),
    ([host_report("a", "10.0.0.1/24", torch="2.13.0+cu130"), *three_hosts()[1:]], None,  # the first host alone
     ["a: torch 2.13.0+cu130 differs from b (2.14.1+cu130)"]),
    ([{"error": "unreachable: timeout"}, *three_hosts(c=host_report("c", "10.0.0.3/24", torch="2.13.0"))[1:]], None,
     ["a: unreachable: timeout", "c: torch 2.13.0 differs from b (2.14.1+cu130)"]),
    (three_hosts(c=host_report("c", "10.0.0.3/24", gpus=gpus(1), nccl="2.27.3"), gpus=gpus(1)), None,
     ["c: NCCL 2.27.3 differs from a (2.30.7)"]),
    ([host_report(n, f"10.0.0.{i}/24", torch=torch) for i, (n, torch) in enumerate(zip(  # NGC's, other commits
        LABELS, ["2.8.0a0+5228986c39.nv25.06"] * 2 + ["2.8.0a0+34c6371d24.nv25.08"]), 1)], None,
     ["c: torch 2.8.0a0+34c6371d24.nv25.08 differs from a (2.8.0a0+5228986c39.nv25.06)"]),
    (three_hosts(c=host_report("c", "10.0.0.3/24", torch="2.14.1+cpu", torchvision="0.29.1+cpu", cuda_runtime=None,
                               nccl=None)), None, []),  # gloo on CPUs: CPU-only and CUDA builds mix
    (three_hosts(b=host_report("b", "10.0.0.2/24", torch="2.14.1", torchvision="0.29.1")), None, []),  # PyPI's
    (three_hosts(b=host_report("b", "10.0.0.2/24", python="3.12.1", torchvision=None, why_missing={
        "torchvision": "torchvision does not import: RuntimeError: operator torchvision::nms does not exist"})), None,
     ["b: python 3.12.1 differs from a (3.11.7)", "b: torchvision missing (torchvision does not import: "
      "RuntimeError: operator torchvision::nms does not exist) differs from a (0.29.1+cu130)"]),
    (three_hosts(c=without_torch("c", "10.0.0.3/24")), None,
     ["c: torch does not import: ModuleNotFoundError: No module named 'torch' (interpreter /usr/bin/python3)"]),
    ([host_report(n, f"10.0.0.{i}/24", gpus=gpus(k)) for i, (n, k) in enumerate(zip(LABELS, [8, 2, 8]), 1)], 4,
     ["b: --nproc 4 but only 2 GPU(s) visible"]),
    ([host_report(n, f"10.0.0.{i}/24", gpus=gpus(k)) for i, (n, k) in enumerate(zip(LABELS, [1, 1, 0]), 1)], None,
     ["c: no GPU visible, but other hosts have GPUs (nccl and gloo do not mix)"]),
    (three_hosts(), 16, []),  # without GPUs the job runs on CPUs: any --nproc
    (three_hosts(b=host_report("b", "10.0.0.2/24", gpus=gpus(4, error=f"RuntimeError: CUDA error: {BUSY}")),
                 c=host_report("c", "10.0.0.3/24", gpus=gpus(4, free_gib=3.2)), gpus=gpus(4)), None,
     [f"b: GPU 1 (NVIDIA H100) cannot be used: RuntimeError: CUDA error: {BUSY}",
      "c: GPU 1 (NVIDIA H100) has 3.2 GiB free of 79.1: other processes hold the rest (one left from an earlier "
      "job? nvidia-smi)"]),
    ([host_report("a", "10.0.0.1/24", torch="2.7.1")], None,
     ["a: torch 2.7.1 is older than 2.8, whose torchrun and gloo fail across hosts (docs/check_env.md): "
      "upgrade torch"]),
    (three_hosts(b=host_report("b", "10.0.0.2/24", env={"GLOO_SOCKET_IFNAME": "eth1", "NCCL_SOCKET_IFNAME": "=eth"}),
                 c=host_report("c", "10.0.0.3/24", env={"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "et,ib"})),
     None, ["b: GLOO_SOCKET_IFNAME=eth1, but it has no interface eth1 (only eth0, lo)",
            "b: NCCL_SOCKET_IFNAME==eth matches none of its interfaces (eth0, lo)"]),
    (three_hosts(b=host_report("b", "10.0.0.2/24", env={"NCCL_SOCKET_IFNAME": "^docker,lo"}),  # to avoid
                 c=host_report("c", "10.0.0.3/24", env={"NCCL_SOCKET_IFNAME": "=eth0:1"})), None, []),
    (three_hosts(b=host_report("b", "10.0.0.2/24", clock_offset=[-41.0, -39.0]),
                 c=host_report("c", "10.0.0.3/24", clock_offset=[3.0, 8.0])), None,  # c: maybe 3.2 s, fine
     ["b: its clock is about 40 s behind a" + CLOCK]),
    ([host_report("a", "10.0.0.1/24", clock_offset=[-41.0, -39.0]), *three_hosts()[1:]], None,  # the first alone
     ["a: its clock is about 40 s behind b" + CLOCK]),
    (three_hosts(b=host_report("b", "10.0.0.2/24", clock_offset=[2.5, 3.5]),  # each near a's, not each other's
                 c=host_report("c", "10.0.0.3/24", clock_offset=[-3.5, -2.5])), None,
     ["b: its clock is about 6 s ahead of c" + CLOCK]),
], ids=["match", "torch", "torch-first-host", "unreachable-first-host", "nccl", "torch-ngc-builds", "cpu-only-build",
        "build-label", "python-torchvision-broken", "no-torch", "nproc-gpus", "gpu-cpu-mix", "cpu-nproc", "gpus-taken",
        "old-torch", "interface-names", "nccl-exclusions-and-ports", "clock-behind", "clock-first-host",
        "clocks-apart"])
def test_find_problems(monkeypatch, reports, nproc, expected):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert check_env.find_problems(LABELS[: len(reports)], reports, nproc) == expected


def test_variables_launch_sh_sends_from_here_are_checked_on_every_host(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")  # this machine's, over each host's own
    reports = three_hosts(env={"GLOO_SOCKET_IFNAME": "eth0"})
    assert check_env.find_problems(LABELS, reports)[0] == "a: GLOO_SOCKET_IFNAME=ib0, but it has no interface ib0 " \
                                                          "(only eth0, lo)"


def compare_with(monkeypatch, capsys, tmp_path, reports, *args):
    """main(--hosts ...) on synthetic reports instead of real hosts: (status, stdout, stderr)."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("a\nb\nc\n")
    monkeypatch.setattr(check_env, "host_reports", lambda hosts, python, hostfile: (LABELS[: len(reports)], reports))
    status = check_env.main(["--hosts", str(hostfile), *args])
    return status, *capsys.readouterr()


def test_matching_hosts_exit_0_and_a_mismatch_1_naming_the_host(monkeypatch, capsys, tmp_path):
    status, out, _ = compare_with(monkeypatch, capsys, tmp_path, three_hosts())
    assert status == 0 and out.endswith("\nOK: all 3 host(s) match on python, torch, torchvision, CUDA runtime and "
                                        "NCCL\n")
    reports = three_hosts(b=host_report("b", "10.0.0.1/24", torch="2.13.0"), c=without_torch("c", "10.0.0.3/24"))
    status, out, _ = compare_with(monkeypatch, capsys, tmp_path, reports)
    assert status == 1
    assert "\n2 problem(s):\nb: torch 2.13.0 differs from a (2.14.1+cu130)\nc: torch does not import" in out
    table = out.splitlines()
    assert table[0].split() == ["a", "b", "c"]
    assert any(line.startswith("* torch ") for line in table)
    assert any(line.startswith("  hostname ") for line in table)  # differs by nature: not marked
    status, out, _ = compare_with(monkeypatch, capsys, tmp_path, reports, "--json")
    assert status == 1 and out.startswith('{\n  "hosts": {\n')
    data = json.loads(out)
    assert list(data["hosts"]) == LABELS and data["problems"][0] == "b: torch 2.13.0 differs from a (2.14.1+cu130)"


@pytest.mark.parametrize("content, named", [("node1\nnode2; touch /tmp/pwned\n", "pwned"), ("node1\nNODE1\n", "NODE1")])
def test_a_bad_hosts_file_is_lib_hosts_sh_s_one_line_and_exit_2(monkeypatch, capsys, tmp_path, content, named):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(content)
    monkeypatch.setattr(check_env, "host_reports", lambda *a: pytest.fail("contacted hosts despite a bad hosts file"))
    assert check_env.main(["--hosts", str(hostfile)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"check_env.py: {hostfile}:2: ") and named in err and err.count("\n") == 1, err


# --------------------------------------------------------------------------
# Running the report on hosts
# --------------------------------------------------------------------------

def test_hosts_are_reached_as_lib_hosts_sh_says_and_the_remote_command_is_quoted(monkeypatch, tmp_path):
    monkeypatch.setenv("SSH_COMMAND", "ssh -F ./cluster_ssh_config")
    (tmp_path / "hosts.txt").write_text("me@node2:2222\nlocalhost\n")
    remote, local = check_env.read_hosts(tmp_path / "hosts.txt")
    python = "/opt/my python/bin/python"
    command = check_env.host_command(remote, python)
    assert command[:3] == ["ssh", "-F", "./cluster_ssh_config"] and "BatchMode=yes" in command
    assert command[-4:] == ["-p", "2222", "me@node2", f"exec '{python}' - --json"]
    assert (local.label, local.local) == ("localhost", True)
    assert check_env.host_command(local, python) == [python, "-", "--json"]


@pytest.mark.parametrize("status, stderr, remote, why", [
    (255, "root@node1: Permission denied (publickey).\r\n", True,  # lib/hosts.sh's reading, as launch.sh's
     f"root@node1: Permission denied (publickey). ({REPO}/setup_ssh.sh hosts.txt installs your key (one with a "
     "passphrase needs ssh-add first))"),
    (255, "Access denied by pam_slurm_adopt: you have no active jobs on this node\nConnection closed by 10.0.0.2\n",
     True, "Access denied by pam_slurm_adopt: you have no active jobs on this node (Slurm lets in only users with a "
     "job there: work in an allocation of them, or use train.sbatch)"),
    (255, "", True, "ssh said nothing"),  # ssh -q in SSH_COMMAND
    (127, "bash: python3: command not found\n", True, "python3 not found (use --python)"),
    (1, "Traceback ...\nSystemError: boom\n", False, "python3 failed with exit status 1: SystemError: boom"),
])
def test_why_a_host_gave_no_report_is_one_line_with_its_fix(status, stderr, remote, why):
    assert check_env.failure(status, stderr, "python3", remote, "hosts.txt") == why


def fake_python(tmp_path, body):
    """A "python" that runs body (sh) instead of the report."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)
    return path


def localhost_with(monkeypatch, capsys, tmp_path, python):
    """main(--hosts) on this machine alone, with python as the interpreter: (status, problems, stderr)."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    status = check_env.main(["--hosts", str(hostfile), "--python", str(python)])
    out, err = capsys.readouterr()
    return status, out.partition("problem(s):\n")[2].splitlines(), err


def test_a_missing_or_too_old_interpreter_is_a_problem_not_a_crash(monkeypatch, capsys, tmp_path):
    missing = tmp_path / "no-python"
    assert localhost_with(monkeypatch, capsys, tmp_path, missing)[:2] == (
        1, [f"localhost: cannot run {missing}: not found"])
    # Python 3.8, as Ubuntu 20.04's python3, where the report would fail on newer syntax.
    old = fake_python(tmp_path, f"exec {sys.executable} -c 'import sys; sys.version_info = (3, 8, 18); "
                                "exec(sys.stdin.read())'")
    assert localhost_with(monkeypatch, capsys, tmp_path, old)[:2] == (
        1, [f"localhost: {old} failed with exit status 1: check_env.py needs Python 3.10 or newer, not 3.8.18"])


def test_a_host_that_does_not_answer_is_named_then_given_up_on(monkeypatch, capsys, tmp_path):
    """Even where a process it started, out of reach of the kill, holds its output open (as
    an ssh ControlMaster does until the remote command ends)."""
    monkeypatch.setattr(check_env, "REPORT_TIMEOUT_S", 2)
    monkeypatch.setattr(check_env, "PATIENCE_S", 0.5)
    slow = fake_python(tmp_path, f"setsid sleep 30 & echo $! > {tmp_path}/held; exec sleep 30")
    start = time.monotonic()
    try:
        status, problems, err = localhost_with(monkeypatch, capsys, tmp_path, slow)
    finally:
        kill_the_pid_in(tmp_path / "held")
    assert (status, problems) == (1, ["localhost: no answer within 2 s"])
    assert err == "check_env.py: still waiting for localhost after 0.5 s (giving up at 2 s)\n"
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_hosts_report_ends_their_commands_at_once(tmp_path, stop_signal):
    slow = fake_python(tmp_path, f"sleep 60 & echo $! > {tmp_path}/pid; wait")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    proc = subprocess.Popen([sys.executable, REPO / "check_env.py", "--hosts", hostfile, "--python", slow],
                            stdout=subprocess.DEVNULL, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text().endswith("\n"):
            assert proc.poll() is None
            time.sleep(0.05)
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=10) == 128 + stop_signal
        assert not is_running(int((tmp_path / "pid").read_text()))
    finally:
        proc.kill()
        proc.wait()
        kill_the_pid_in(tmp_path / "pid")


def kill_the_pid_in(pid_file):
    if pid_file.exists() and pid_file.read_text().strip() and is_running(int(pid_file.read_text())):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


def is_running(pid):
    """Whether pid exists and is not a zombie waiting for its new parent to reap it."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# --------------------------------------------------------------------------
# --slurm, through a fake srun
# --------------------------------------------------------------------------

def test_slurm_outside_an_allocation_is_one_line_and_exit_2(monkeypatch, capsys):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert check_env.main(["--slurm"]) == 2
    assert capsys.readouterr().err == ("check_env.py: --slurm runs inside a SLURM allocation (salloc or sbatch): "
                                       "SLURM_JOB_ID is not set\n")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("PATH", "/nonexistent")  # no scontrol
    assert check_env.main(["--slurm"]) == 2
    assert capsys.readouterr().err == "check_env.py: --slurm needs SLURM's scontrol, and there is none on PATH\n"


def labelled(task, text):
    """text as srun --label gives a task's output."""
    return [f"{task}: {line}" for line in text.splitlines()]


def test_slurm_compares_every_node_through_srun_and_names_the_one_that_differs(monkeypatch, capsys, tmp_path):
    node = [json.dumps(host_report(f"node{i}", f"10.0.0.{i}/24", torch="2.13.0" if i == 2 else "2.14.1"),
                       indent=2) for i in (1, 2)]
    out = [line for pair in zip(labelled(0, node[0]), labelled(1, node[1])) for line in pair]  # interleaved
    err = [*labelled(2, "slurmstepd: error: execve(): python9: No such file or directory"),
           "srun: error: node3: task 2: Exited with exit code 2"]
    (tmp_path / "out").write_text("\n".join(out) + "\n")
    (tmp_path / "err").write_text("\n".join(err) + "\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_python(bin_dir, f'printf "%s\\n" "$@" > {tmp_path}/args; cat > {tmp_path}/stdin; cat {tmp_path}/out; '
                         f"cat {tmp_path}/err >&2; exit 1").rename(bin_dir / "srun")
    scontrol = fake_python(bin_dir, 'test "$*" = "show hostnames" && printf "node1\\nnode2\\nnode3\\n"')
    scontrol.rename(bin_dir / "scontrol")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    assert check_env.main(["--slurm", "--python", "python9"]) == 1
    stdout = capsys.readouterr().out
    assert stdout.splitlines()[0].split() == ["node1", "node2", "node3"]
    assert stdout.partition("problem(s):\n")[2].splitlines() == [
        "node2: torch 2.13.0 differs from node1 (2.14.1)",
        "node3: no report from srun: slurmstepd: error: execve(): python9: No such file or directory"]
    assert (tmp_path / "args").read_text().split() == [
        "--nodes=3", "--ntasks=3", "--ntasks-per-node=1", "--overlap", "--kill-on-bad-exit=0", "--label", "python9",
        "-", "--json"]
    assert (tmp_path / "stdin").read_bytes() == (REPO / "check_env.py").read_bytes()  # streamed to every node


# --------------------------------------------------------------------------
# All-reduce
# --------------------------------------------------------------------------

ALLREDUCE_SIZES = ["1 KiB", "4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB"]


def allreduce_rows(stdout):
    """The benchmark's table rows, split: size, unit, time, algbw, busbw, check (after any
    host prefix launch.sh adds)."""
    return [match.split() for match in re.findall(r"^.*?( +\d+ [KM]iB .*)$", stdout, re.M)]


def test_allreduce_on_this_machine_with_two_processes(tmp_path):
    result = run_check_env(["--allreduce", "--nproc", "2"], timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all-reduce, float32 sum, gloo, 1 node(s), 2 ranks" in result.stdout
    rows = allreduce_rows(result.stdout)
    assert [" ".join(row[:2]) for row in rows] == ALLREDUCE_SIZES
    for row in rows:
        time_us, algbw, busbw = map(float, row[2:5])
        assert row[5] == "ok" and time_us > 0 and busbw == pytest.approx(algbw * 2 * (2 - 1) / 2, abs=0.002)
    assert f"busbw at 64 MiB: {rows[-1][4]} GB/s (averaged over every size" in result.stdout


def test_allreduce_usage_errors(capsys):
    assert check_env.main(["--allreduce", "--nproc", "1"]) == 2  # its bandwidth would be a copy's
    assert capsys.readouterr().err == "check_env.py: --allreduce needs 2 processes or more: add --nproc 2\n"
    with pytest.raises(SystemExit) as exited:
        check_env.main(["--allreduce", "--json"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.endswith(" error: argument --json: not allowed with --allreduce, which prints a "
                                            "table\n")


def test_allreduce_across_hosts_runs_launch_sh_after_the_comparison(monkeypatch, capsys, tmp_path):
    ran = []
    monkeypatch.setattr(check_env.os, "execvp", lambda file, argv: ran.append(argv))
    reports = three_hosts(gpus=gpus(2))  # one process per GPU, by default
    assert compare_with(monkeypatch, capsys, tmp_path, reports, "--allreduce", "--timeout", "9")[0] is None
    torchrun = Path(sys.executable).parent / "torchrun"
    assert ran == [["bash", str(REPO / "launch.sh"), "--torchrun", str(torchrun), "--workdir", str(REPO),
                    str(tmp_path / "hosts.txt"), "2", str(REPO / "check_env.py"), "--allreduce", "--timeout=9"]]
    ran.clear()
    reports[1]["torch"] = "2.13.0"
    assert compare_with(monkeypatch, capsys, tmp_path, reports, "--allreduce")[0] == 1 and ran == []  # problems first
    assert compare_with(monkeypatch, capsys, tmp_path, [host_report("a", "10.0.0.1/24")], "--allreduce") == (
        2, "", "check_env.py: --allreduce needs 2 processes or more, and this is 1 host x 1 process: add hosts, or "
        "--nproc 2\n")
