"""launch.sh against a simulated cluster of real sshd hosts (see cluster.py)."""

import contextlib
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cluster import (cluster_fixture, keys_no_host_knows, launched_processes, require_prerequisites,
                     simulated_cluster)
from conftest import HIDDEN_GPUS, REPO, TINY, default_sigint, linux_only, load, run, skip_or_fail

pytestmark = linux_only("launch.sh's hosts read /proc, and most tests run one here")

LAUNCH = REPO / "launch.sh"
TRAIN = ["train.py", "--arch", "cnn", "--dataset", "synthetic"]
ODD_ARG = "two words 'quoted' \"double\" $(touch x) `touch y` ; * a\\b \\' !1 %s"
LOGIN_SHELLS = {"node1": "/usr/bin/fish", "node2": "/usr/bin/tcsh"}  # they parse unlike sh
UNTIL_STOPPED = ["--epochs", "1000", "--log-every", "5"]
SHELL_SCRIPTS = ("launch.sh", "setup_ssh.sh", "lib/hosts.sh", "lib/node.sh", "bench/gpu.sh")

cluster = cluster_fixture(n_hosts=3)


@pytest.fixture
def train(mnist_dir):
    """train.py and its arguments for a job that trains: conftest's tiny MNIST, which every
    host reads (they share this machine's filesystem)."""
    return ["train.py", *TINY, "--data", mnist_dir]


def launch_env(cluster=None, **extra):
    """Environment for launch.sh: this python's torchrun first on PATH, and the GPUs
    hidden, which launch.sh forwards to every host."""
    env = {
        **(cluster.env() if cluster else {**os.environ, **HIDDEN_GPUS}),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "OMP_NUM_THREADS": "1",
    }
    return {**env, **extra}


class Launch:
    """launch.sh in the background, in a session of its own, with SIGINT at
    its default disposition (see default_sigint)."""

    def __init__(self, args, env, cwd, out_dir):
        self.out_path, self.err_path = out_dir / "launch.out", out_dir / "launch.err"
        # TMPDIR: what a killed launch.sh cannot remove stays there. The mark: every
        # process it starts here carries it, also those it starts in sessions of their own.
        mark = os.urandom(8).hex()
        self.mark = f"TEST_LAUNCH={mark}".encode()
        env = {**env, "TMPDIR": str(out_dir), "TEST_LAUNCH": mark}
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                [LAUNCH, *map(str, args)], cwd=cwd, env=env, stdout=out, stderr=err,
                start_new_session=True, preexec_fn=default_sigint,
            )
        self.pid = self.proc.pid

    @property
    def out(self):
        return self.out_path.read_text()

    @property
    def err(self):
        return self.err_path.read_text()

    def wait(self, timeout):
        """Exit status; fail (after killing the launch) if it takes longer."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"launch.sh still running after {timeout}s\n{self.out}\n{self.err}")

    def wait_for_output(self, pattern, timeout=90, stream="out"):
        """Wait until pattern appears in launch.sh's stdout (stream="out") or stderr ("err")."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, getattr(self, stream), re.M):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no {pattern!r} in its std{stream}\n{self.out}\n{self.err}")
            time.sleep(0.2)

    def job_id(self):
        return re.search(r"^launch.sh: job (\S+),", self.err, re.M).group(1)

    def processes(self):
        """Pids of launch.sh and what it started here (a zombie in its session only)."""
        return launched_processes(self.pid, self.mark)

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def start(tmp_path, request):
    """start(args, env, cwd=REPO) -> Launch; everything is killed afterwards."""
    launches = []

    def _start(args, env, cwd=REPO):
        launches.append(Launch(args, env, cwd, tmp_path))
        return launches[-1]

    yield _start
    for launch in launches:
        launch.kill()
        for pid in job_processes(launch):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    if "cluster" in request.fixturenames:
        the_cluster = request.getfixturevalue("cluster")
        for host in the_cluster.hosts:
            the_cluster.kill_all(host)


def run_launch(start, args, env, timeout=120, cwd=REPO):
    launch = start(args, env, cwd)
    launch.wait(timeout)
    return launch


def stat_fields(pid):
    """/proc/PID/stat's fields after the command's name, from the state on; None if gone."""
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return None


def assert_nothing_left(cluster, launch, timeout=10):
    """No process of the job on any host, nor any ssh client here."""
    left = cluster.wait_until_idle(timeout)
    assert not left, f"left running: {left}"
    deadline = time.monotonic() + timeout
    while launch.processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not launch.processes()


def job_processes(launch):
    """Pids of the processes of launch's job, whose id is TIME-PID-RANDOM: those with its
    LAUNCH_JOB mark, and a local node's run_node, whose first argument is JOB/HOST_NUMBER.
    (A local node runs in a session of its own, out of reach of a kill of launch's group.)"""
    job = rb"\d{8}-\d{6}-%d-[0-9a-f]{4}/" % launch.pid
    pids = []
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError):
            if (re.search(rb"(^|\0)LAUNCH_JOB=" + job, Path(f"/proc/{entry.name}/environ").read_bytes())
                    or re.search(rb"\0" + job, Path(f"/proc/{entry.name}/cmdline").read_bytes())):
                pids.append(int(entry.name))
    return pids


def workers(cluster, host):
    """Pids of the training processes (not torchrun) on host."""
    return [
        pid
        for pid, argv in cluster.processes(host)
        if "train.py" in argv and not any(a.endswith("torchrun") for a in argv)
    ]


FAKETIME_LIBRARY = next(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"), None)


def ssh_here(tmp_path):
    """An SSH_COMMAND that runs the remote command on this machine, through sh, with the
    SSH_CONNECTION each made-up host would have: two containers share one address, a
    tunnel ends at 127.0.0.1, "self" is this machine, one sshd sets none, "mute" fails
    without a word (as ssh -q does), "stuck" never answers, "lingers" keeps its session open
    once its command has ended (as where a login script's background program holds its
    output), "hung" never ends once its part of a job has (as where a hung mount holds the
    clean-up; its preflight ends), the clocks of "ahead4" and "behind40" (say) are off by
    that many seconds (in the time that the check reports: libfaketime fakes bash's clock
    only now and then), and h1, h2, ... are at 10.9.1.1, 10.9.1.2, ... and
    see this machine at 127.0.0.1: a rendezvous here, which each host tries as it starts,
    is reached without a packet leaving it."""
    script = tmp_path / "ssh-here"
    script.write_text(
        '#!/usr/bin/env bash\n'
        'host=${*: -2:1}\n'
        'case $host in\n'
        '  stuck) exec sleep 600 ;;\n'
        '  mute) exit 255 ;;\n'
        '  box1 | box2) export SSH_CONNECTION="10.9.0.1 40000 172.17.0.2 22" ;;\n'
        '  tunnel) export SSH_CONNECTION="127.0.0.1 40000 127.0.0.1 22" ;;\n'
        '  bare) unset SSH_CONNECTION ;;\n'
        '  self) here=$(hostname -I); export SSH_CONNECTION="127.0.0.1 40000 ${here%% *} 22" ;;\n'
        '  h[0-9]*) export SSH_CONNECTION="127.0.0.1 40000 10.9.1.${host#h} 22" ;;\n'
        '  *) export SSH_CONNECTION="10.9.0.1 40000 10.9.0.${#host} 22" ;;\n'
        'esac\n'
        'payload=${*: -1}; payload=${payload#*echo }\n'  # (see remote_bash_command)
        'if [[ $host == lingers || ($host == hung && $(base64 -d <<<"${payload%% *}") == *run_node*) ]]; then\n'
        '  sh -c "${*: -1}"; exec sleep 600\n'
        'fi\n'
        'if [[ $host =~ ^(ahead|behind)([0-9]+)$ ]]; then\n'
        '  offset=${BASH_REMATCH[2]}; if [[ ${BASH_REMATCH[1]} == behind ]]; then offset=-$offset; fi\n'
        '  sh -c "${*: -1}" | awk -v offset="$offset" \'/^ok / { $NF += offset } { print }\'\n'
        '  exit "${PIPESTATUS[0]}"\n'
        'fi\n'
        'exec sh -c "${*: -1}"\n'
    )
    script.chmod(0o755)
    return str(script)


def fake_ssh(tmp_path):
    """An SSH_COMMAND that only records that it was called."""
    script = tmp_path / "fake-ssh"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "ssh-called"}\nexit 255\n')
    script.chmod(0o755)
    return str(script), tmp_path / "ssh-called"


def stand_in_torchrun(tmp_path, body):
    """A torchrun for --torchrun that runs body, a sh script: for what launch.sh alone does
    with a host's command, its environment and its output, without torch's seconds of start-up.
    Beside it, as in a venv, this python: it runs launch.sh's rendezvous probe on the hosts."""
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(f"#!/bin/sh\n{body}\n")
    torchrun.chmod(0o755)
    (tmp_path / "python").symlink_to(sys.executable)
    return torchrun


def test_success_on_three_hosts(cluster, tmp_path, start, train):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt")
    env_file = tmp_path / "env"
    env_file.write_text("# torchrun logs at INFO, so every host prints something\nLOGLEVEL=INFO\n")
    metrics = tmp_path / "metrics.jsonl"
    launch = run_launch(
        start,
        ["--workdir", REPO, "--env-file", env_file, hostfile, "1",
         *train, "--epochs", "1", "--max-steps", "6", "--metrics", metrics],
        launch_env(cluster), cwd=tmp_path,
    )
    assert launch.proc.returncode == 0, launch.out + launch.err
    assert re.search(r"^node[123]: start: world_size=3 backend=gloo", launch.out, re.M)
    assert '"world_size": 3' in metrics.read_text()
    logs = tmp_path / "logs" / launch.job_id()
    for host in cluster.hosts:
        assert re.search(rf"^{host}: ", launch.out, re.M), f"no line from {host}"
        assert re.search(rf"^  {host} +0 ", launch.err, re.M), f"{host} not in the summary"
        log = (logs / f"{host}.log").read_text()
        assert log and all(f"{host}: {line}" in launch.out for line in log.splitlines())
    assert_nothing_left(cluster, launch)


def test_output_lines_arrive_whole(cluster, tmp_path, start):
    # Remote stdout and stderr travel on separate ssh channels; merged only here, they
    # would cut each other's lines at arbitrary bytes.
    launch = start(
        ["--log-dir", tmp_path / "logs",
         cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:2]), "2",
         "tests/noisy_probe.py"],
        launch_env(cluster),
    )
    assert launch.wait(60) == 0, launch.out + launch.err
    noisy = [line for line in launch.out.splitlines() if "noisy:" in line]
    whole = re.compile(r"^node[12]: noisy: rank=[0-3] line=\d+ x{200} end$")
    assert len(noisy) == 2 * 2 * 2 * 300
    assert [line for line in noisy if not whole.match(line)] == []


@contextlib.contextmanager
def programs_started(pids, trace):
    """Record in file trace every program started by the processes pids and their
    descendants while the with block runs: execve with its arguments (not its environment)."""
    if not shutil.which("strace"):
        skip_or_fail("strace not installed")
    log = trace.with_suffix(".log")
    with open(log, "w") as err:
        tracer = subprocess.Popen(["strace", "-f", "-e", "trace=execve", "-s", "100000", "-o", trace,
                                   *[arg for pid in pids for arg in ("-p", str(pid))]], stderr=err)
    try:
        deadline = time.monotonic() + 10
        while log.read_text().count(" attached") < len(pids):
            assert tracer.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield
    finally:
        tracer.terminate()  # strace detaches and leaves the processes running
        try:
            tracer.wait(10)
        except subprocess.TimeoutExpired:
            tracer.kill()
            tracer.wait()


def test_env_forwarded_args_quoted_and_no_values_in_ps(cluster, tmp_path, start):
    # One larger than a pipe holds (64 KiB on Linux), as a long PYTHONPATH from Spack might be.
    secret, torch_secret = "s3cret-from-env-file-" + "x" * 70_000, "s3cret-from-environment"
    env_file = tmp_path / "env"
    env_file.write_text(f"PROBE_SECRET={secret}\n")
    sshds = [cluster.host(name).sshd_pid() for name in cluster.hosts[:2]]
    with programs_started(sshds, tmp_path / "execve.trace"):
        launch = run_launch(
            start,
            ["--log-dir", tmp_path / "logs", "--env-file", env_file,
             cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:2]), "2",
             "tests/dist_probe.py", "--steps", "8", "--echo", ODD_ARG],
            launch_env(cluster, TORCH_PROBE_SECRET=torch_secret, LAUNCHER_ONLY="not forwarded"),
            timeout=60,
        )
    assert launch.proc.returncode == 0, launch.out + launch.err
    execs = (tmp_path / "execve.trace").read_text()
    assert re.search(r'execve\("[^"]*/torchrun", ', execs)  # the trace saw the job start
    assert secret not in execs and torch_secret not in execs  # in no program's arguments
    reports = re.findall(r"^(node\d): probe: rank=(\d) world_size=4 sum=6 (.*)$", launch.out, re.M)
    assert sorted(rank for _, rank, _ in reports) == ["0", "1", "2", "3"]
    assert sorted(host for host, _, _ in reports) == ["node1", "node1", "node2", "node2"]
    for _, _, rest in reports:
        assert (f"PROBE_SECRET=sha256:{hashlib.sha256(secret.encode()).hexdigest()} "
                f"TORCH_PROBE_SECRET={torch_secret} LAUNCHER_ONLY=None") in rest
        assert "GLOO_SOCKET_IFNAME=eth0" in rest  # the interface of the address the others reach
        assert rest.endswith(f"echo={ODD_ARG!r}")
    assert not (REPO / "x").exists() and not (REPO / "y").exists()
    assert_nothing_left(cluster, launch)


def gloo_interface_on_node1(cluster, tmp_path, start, bashrc="", env_lines=""):
    """The GLOO_SOCKET_IFNAME of a job on node1, where ~/.bashrc (which bash reads for ssh
    commands) holds bashrc, and launch.sh's --env-file env_lines."""
    env_file = tmp_path / "env"
    env_file.write_text(env_lines)
    bashrc_path = cluster.host("node1").dir / "home" / ".bashrc"
    bashrc_path.write_text(bashrc)
    torchrun = stand_in_torchrun(tmp_path, 'echo "GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME"')
    try:
        launch = run_launch(
            start, ["--log-dir", tmp_path / "logs", "--env-file", env_file, "--torchrun", torchrun,
                    cluster.write_hostfile(tmp_path / "hosts.txt", ["node1"]), "1", *TRAIN],
            launch_env(cluster), timeout=60,
        )
    finally:
        bashrc_path.unlink()
    assert launch.proc.returncode == 0, launch.out + launch.err
    return re.search(r"^node1: GLOO_SOCKET_IFNAME=(.*)$", launch.out, re.M).group(1)


@pytest.mark.parametrize("where", ["env-file", "host"])
def test_gloo_interface_given_is_kept(cluster, tmp_path, start, where):
    given = "GLOO_SOCKET_IFNAME=lo\n"
    if where == "env-file":
        assert gloo_interface_on_node1(cluster, tmp_path, start, env_lines=given) == "lo"
    else:
        assert gloo_interface_on_node1(cluster, tmp_path, start, bashrc=f"export {given}") == "lo"


@pytest.mark.parametrize("sent, problem", [
    ({"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth"}, None),
    ({"NCCL_SOCKET_IFNAME": "=eth0:1,ib0"}, None),  # NCCL takes NAME:PORT too
    ({"NCCL_SOCKET_IFNAME": "^docker,ib"}, None),
    ({"GLOO_SOCKET_IFNAME": "eth0,ens5,ib0"}, "GLOO_SOCKET_IFNAME=eth0,ens5,ib0 (from launch.sh), but no interface "
                                              "ens5 ib0 here (only lo eth0): unset it, and launch.sh picks each "
                                              "host's own"),
    ({"NCCL_SOCKET_IFNAME": "ib,,ens"}, "NCCL_SOCKET_IFNAME=ib,,ens (from launch.sh) matches no interface here "
                                        "(only lo eth0)"),  # an empty item matches none
    ({"NCCL_SOCKET_IFNAME": "=eth"}, "NCCL_SOCKET_IFNAME==eth (from launch.sh) matches no interface here "
                                     "(only lo eth0)"),
], ids=["names", "exact", "avoided", "gloo_missing", "nccl_prefix_missing", "nccl_exact_missing"])
def test_preflight_checks_the_interfaces_named_for_gloo_and_nccl(cluster, tmp_path, start, sent, problem):
    """Names differ from host to host (eth0, ens5): gloo would fail at start-up on one a host
    lacks, NCCL at its first collective."""
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", "node2"])
    launch = run_launch(start, ["--dry-run", hostfile, "1", *TRAIN], launch_env(cluster, **sent), timeout=30)
    if problem is None:
        assert launch.proc.returncode == 0, launch.err
    else:
        assert launch.proc.returncode == 1
        for host in ("node1", "node2"):
            assert re.search(rf"^  {host}  {re.escape(problem)}$", launch.err, re.M), launch.err


def test_preflight_checks_a_hosts_own_gloo_interface(cluster, tmp_path, start):
    bashrc = cluster.host("node2").dir / "home" / ".bashrc"  # read by bash for ssh commands
    bashrc.write_text("export GLOO_SOCKET_IFNAME=ens5\n")
    try:
        launch = run_launch(start, ["--dry-run", cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", "node2"]),
                                    "1", *TRAIN], launch_env(cluster), timeout=30)
    finally:
        bashrc.unlink()
    assert launch.proc.returncode == 1
    assert re.findall(r"^  (\S+) +(.*)$", launch.err, re.M) == [
        ("node2", "GLOO_SOCKET_IFNAME=ens5 (set on this host), but no interface ens5 here (only lo eth0): unset "
                  "it, and launch.sh picks each host's own")], launch.err


def test_gloo_interface_found_on_a_host_without_ip(cluster, tmp_path, start):
    """A host without iproute2 (a container, say): Python finds the interface instead."""
    tools = tmp_path / "tools"  # all that the host's PATH holds
    tools.mkdir()
    for tool in ("bash", "base64", "sh", "cat", "grep", "cut", "sleep"):
        (tools / tool).symlink_to(shutil.which(tool))
    assert gloo_interface_on_node1(cluster, tmp_path, start, bashrc=f"PATH={tools}\n") == "eth0"


@pytest.mark.parametrize("named", [True, False], ids=["name_at_its_address", "name_at_127.0.1.1"])
def test_hosts_with_their_address_on_lo_as_on_routed_fabrics(tmp_path, start, train, named):
    """Routed fabrics put each host's address on lo, as a /32. GLOO_SOCKET_IFNAME=lo would
    bind lo's first address, 127.0.0.1, where each host reaches only itself: gloo must go
    by the address of the host's name, which the fabric's DNS gives, and without it cannot
    work."""
    require_prerequisites()
    with simulated_cluster(2, routed="lo") as fabric:
        if named:
            for name in fabric.hosts:
                hosts_file = Path("/etc/netns") / fabric.host(name).netns / "hosts"
                hosts_file.write_text(f"127.0.0.1 localhost\n{fabric.address(name)} {name}\n")
        hostfile = fabric.write_hostfile(tmp_path / "hosts.txt")
        launch = run_launch(start, [hostfile, "1", *train, "--max-steps", "2"], launch_env(fabric))
        warnings = re.findall(r"^(node[12]): launch.sh: warning: gloo cannot bind (\S+) here, .* this "
                              r"host's name, \1, resolves to (\S+); map \1 to \2 in /etc/hosts here$",
                              launch.out, re.M)
        if named:
            assert launch.proc.returncode == 0, launch.out + launch.err
            assert "start: world_size=2 backend=gloo" in launch.out and not warnings, launch.out
        else:
            assert launch.proc.returncode == 1
            assert sorted(warnings) == [(name, fabric.address(name), "127.0.1.1")
                                        for name in fabric.hosts], launch.out
            # train.py refuses at once (launch.sh may stop the second host before it says so)
            refusals = re.findall(r"^(node[12]): .*train.py: error: this host's name, \1, gives "
                                  r"gloo 127.0.1.1 to listen on", launch.out + launch.err, re.M)
            assert refusals and set(refusals) <= set(fabric.hosts), launch.out + launch.err
        assert_nothing_left(fabric, launch)


def test_dry_run_prints_every_command_and_starts_nothing(cluster, tmp_path, start):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("# rendezvous host first\n\n  root@node1:22  # with user and port\nnode2\n")
    launch = run_launch(
        start, ["--dry-run", "--log-dir", tmp_path / "logs", hostfile, "2", *TRAIN, "--epochs", "1"],
        launch_env(cluster), timeout=30,
    )
    assert launch.proc.returncode == 0, launch.err
    node1, node2 = cluster.address("node1"), cluster.address("node2")
    lines = launch.out.splitlines()
    assert re.fullmatch(r"environment on every host \(a local one also has the rest of this shell's\): "
                        r".*TORCH_DISABLE_SHARE_RDZV_TCP_STORE.*", lines[0])
    assert lines[1].startswith("root@node1:22 (ssh -p 22 root@node1): cd ")
    assert lines[2].startswith("node2 (ssh node2): cd ")
    for line, address in ((lines[1], node1), (lines[2], node2)):
        assert re.search(rf"'--rdzv-endpoint={node1}:\d+' '--rdzv-id=\S+' ", line)
        assert f"'--local-addr={address}'" in line
        assert "'--nnodes=2' '--nproc-per-node=2'" in line
        assert line.endswith("'train.py' '--arch' 'cnn' '--dataset' 'synthetic' '--epochs' '1'")
    assert not (tmp_path / "logs").exists()
    assert not cluster.wait_until_idle(0)


def test_a_login_banner_without_a_newline_passes_preflight(cluster, tmp_path, start):
    bashrc = cluster.host("node1").dir / "home" / ".bashrc"  # read by bash for ssh commands
    bashrc.write_text("printf 'Loading modules...'\n")
    try:
        launch = run_launch(start, ["--dry-run", cluster.write_hostfile(tmp_path / "hosts.txt", ["node1"]),
                                    "1", *TRAIN], launch_env(cluster), timeout=30)
    finally:
        bashrc.unlink()
    assert launch.proc.returncode == 0, launch.err


def test_ssh_config_that_forces_a_terminal_runs_a_command_and_forwards_a_port_in_use(cluster, tmp_path, start):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", "node2"])
    with cluster.ssh_with_an_interactive_config(tmp_path / "ssh_config", "RequestTTY force\n") as ssh:
        launch = run_launch(start, ["--dry-run", hostfile, "1", *TRAIN], launch_env(cluster, SSH_COMMAND=ssh),
                            timeout=30)
    assert launch.proc.returncode == 0, launch.err
    assert re.search(rf"'--rdzv-endpoint={cluster.address('node1')}:\d+' ", launch.out), launch.out


def test_one_connection_to_a_bastion_serves_the_whole_launch(cluster, tmp_path, start):
    """Through a bastion with a ControlMaster (as the README advises), the first host's check
    opens the master before the others start: all at once, each would open a connection of
    its own, and more than sshd's MaxStartups (10) drop some ("kex_exchange_identification")."""
    bastion_log = cluster.host("node1").dir / "sshd.log"
    torchrun = stand_in_torchrun(tmp_path, "echo started")
    accepted_before = bastion_log.read_text().count("Accepted publickey")
    with cluster.ssh_through_control_masters(tmp_path / "ssh_config", ["node1"], behind=["node2", "node3"]) as ssh:
        launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun,
                                    cluster.write_hostfile(tmp_path / "hosts.txt", ["node2", "node3"]), "1", *TRAIN],
                            launch_env(cluster, SSH_COMMAND=ssh), timeout=60)
        assert launch.proc.returncode == 0, launch.err
        assert sorted(re.findall(r"^(node\d): started$", launch.out, re.M)) == ["node2", "node3"], launch.out
        assert bastion_log.read_text().count("Accepted publickey") - accepted_before == 1


def test_dry_run_local_host_first_with_fixed_port(cluster, tmp_path, start):
    """A local first host serves the rendezvous on the address the others see."""
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["localhost", "node1"])
    launch = run_launch(
        start, ["--dry-run", "--port=29999", hostfile, "1", *TRAIN], launch_env(cluster), timeout=30
    )  # --port=N, as torchrun's options are often written, and --port N
    assert launch.proc.returncode == 0, launch.err
    lines = launch.out.splitlines()
    assert lines[1].startswith("localhost (local): ") and lines[2].startswith("node1 (ssh node1): ")
    for line in lines[1:]:
        assert f"'--rdzv-endpoint={cluster.local_address}:29999'" in line
    assert f"'--local-addr={cluster.local_address}'" in lines[1]
    assert f"'--local-addr={cluster.address('node1')}'" in lines[2]


def test_preflight_rejects_a_port_in_use_on_the_first_host(cluster, tmp_path, start):
    listener = subprocess.Popen(cluster.command("node1", [
        sys.executable, "-c", "import socket, time; s = socket.socket(); s.bind(('', 29999)); "
        "s.listen(); print('listening', flush=True); time.sleep(60)"]),
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert listener.stdout.readline() == "listening\n"
        hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", "node2"])
        launch = run_launch(start, ["--dry-run", "--port", "29999", hostfile, "1", *TRAIN],
                            launch_env(cluster), timeout=30)
        assert launch.proc.returncode == 1, launch.out + launch.err
        assert re.search(r"^  node1 +port 29999 \(--port\) cannot be bound here: Address already in use$",
                         launch.err, re.M), launch.err
    finally:
        os.killpg(listener.pid, signal.SIGKILL)
        listener.wait()


def test_a_pyenv_shim_is_resolved_to_the_torchrun_it_stands_for(tmp_path, start):
    real = Path(sys.executable).parent / "torchrun"
    for name, text in (("shims/torchrun", "exit 1"), ("bin/pyenv", f"echo {real}")):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"#!/bin/sh\n{text}\n")
        (tmp_path / name).chmod(0o755)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    env = launch_env(PATH=f"{tmp_path / 'shims'}:{tmp_path / 'bin'}:{os.environ['PATH']}")
    launch = run_launch(start, ["--dry-run", hostfile, "1", *TRAIN], env, timeout=30)
    assert launch.proc.returncode == 0, launch.err
    assert f"&& '{real}' '--nnodes=1'" in launch.out, launch.out


def test_a_tilde_after_an_options_equals_sign_is_the_home_directory(tmp_path, start):
    """The shell expands --workdir ~/x, but not --workdir=~/x."""
    (tmp_path / "x").mkdir()
    shutil.copy(REPO / "train.py", tmp_path / "x")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    launch = run_launch(start, ["--dry-run", "--workdir=~/x", hostfile, "1", *TRAIN],
                        launch_env(HOME=str(tmp_path)), timeout=30)
    assert launch.proc.returncode == 0, launch.err
    assert f"cd '{tmp_path / 'x'}' && " in launch.out, launch.out


@pytest.mark.parametrize("first_line, env_file, problem", [
    (f"#!{sys.executable}", "", None),  # pip's torchrun, with no python beside it
    ("#!/bin/sh", "", "no Python 3 for launch.sh's probes: none beside {torchrun} or on its #! line, "
                      "no python3 on PATH"),
    ("#!/gone/bin/python3", "", "no /gone/bin/python3 here, torchrun's Python (a venv made on another "
                                "machine?)"),
    ("#!{needs_library}", "", "{needs_library} does not start here (an LD_LIBRARY_PATH for --env-file?): "
                              "python3: error while loading shared libraries: libpython3.11.so.1.0: "
                              "cannot open shared object file: No such file or directory"),
    ("#!{needs_library}", "LD_LIBRARY_PATH=/opt/python/lib\n", None),  # as Lmod's modules need
], ids=["pip", "none", "missing", "needs_a_library", "library_path_sent"])
def test_preflight_finds_torchruns_python_on_a_host_without_python3(tmp_path, start, first_line, env_file,
                                                                   problem):
    """The probes run on torchrun's own Python where no python3 is on the host's PATH (as
    after python3.11 -m pip install --user torch on RHEL 8), with the job's variables, and
    preflight says so where there is none that starts."""
    needs_library = tmp_path / "python3"  # a Python that starts only with LD_LIBRARY_PATH set
    needs_library.write_text(
        '#!/bin/sh\n[ -n "$LD_LIBRARY_PATH" ] || { echo "python3: error while loading shared libraries: '
        'libpython3.11.so.1.0: cannot open shared object file: No such file or directory" >&2; exit 127; }\n'
        f'exec {sys.executable} "$@"\n')
    needs_library.chmod(0o755)
    torchrun = tmp_path / "pip" / "torchrun"
    torchrun.parent.mkdir()
    torchrun.write_text(first_line.format(needs_library=needs_library) + "\n")
    torchrun.chmod(0o755)
    (tmp_path / "env").write_text(env_file)
    tools = tmp_path / "tools"  # all that the host's PATH holds
    tools.mkdir()
    for tool in ("bash", "base64", "sh"):
        (tools / tool).symlink_to(shutil.which(tool))
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("host\n")
    launch = run_launch(start, ["--dry-run", "--torchrun", torchrun, "--env-file", tmp_path / "env", hostfile,
                                "1", *TRAIN],
                        launch_env(SSH_COMMAND=f"env PATH={tools} {ssh_here(tmp_path)}"), timeout=30)
    if problem is None:
        assert launch.proc.returncode == 0, launch.err
    else:
        assert launch.proc.returncode == 1, launch.err
        line = "  host  " + problem.format(torchrun=torchrun, needs_library=needs_library)
        assert launch.err.splitlines()[1].startswith(line), launch.err


@pytest.mark.parametrize("script", ["launch.sh", "setup_ssh.sh"])
def test_a_blank_SSH_COMMAND_is_ssh(tmp_path, script):
    """As in check_env.py: SSH_COMMAND=" " runs ssh, not its options as the command."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("host\n")
    args = {"launch.sh": ["--dry-run", hostfile, "1", *TRAIN], "setup_ssh.sh": ["--key", tmp_path / "id", hostfile]}
    ssh_command, ssh_called = fake_ssh(tmp_path)
    Path(ssh_command).rename(tmp_path / "ssh")
    env = launch_env(SSH_COMMAND=" ")
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    result = run([REPO / script, *args[script]], timeout=30, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stdout + result.stderr
    assert " host " in ssh_called.read_text()


@pytest.mark.parametrize("name", [socket.gethostname(), "box", "127.0.0.1", "\ufefflocalhost"],
                         ids=["own_name", "short_name", "loopback", "after_a_byte_order_mark"])
def test_own_name_and_loopback_run_locally(tmp_path, start, name):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{name}\n")
    ssh_command, ssh_called = fake_ssh(tmp_path)
    names = tmp_path / "names"  # where this machine's full name is box.example.org (RHEL's way)
    names.mkdir()
    for tool in ("uname", "hostname"):
        (names / tool).write_text(f'#!/bin/sh\n[ "$1" = -I ] && exec {shutil.which(tool)} "$@"\n'
                                  'echo box.example.org\n')
        (names / tool).chmod(0o755)
    path = f"{names}:{launch_env()['PATH']}" if name == "box" else launch_env()["PATH"]
    launch = run_launch(start, ["--dry-run", hostfile, "1", *TRAIN],
                        launch_env(SSH_COMMAND=ssh_command, PATH=path), timeout=30)
    assert launch.proc.returncode == 0, launch.err
    lines = launch.out.splitlines()
    assert lines[1].startswith(f"{name.lstrip(chr(0xFEFF))} (local): ")
    assert "'--rdzv-endpoint=127.0.0.1:" in lines[1]
    assert not ssh_called.exists()


@pytest.mark.parametrize(
    "hostfile, nproc, message",
    [
        (None, "2", "no such file"),
        ("", "2", "no hosts"),
        ("# only a comment\n\n", "2", "no hosts"),
        ("localhost;touch {marker}\n", "2", "not a [user@]host[:port]"),
        ("localhost\n$(touch {marker})\n", "2", "not a [user@]host[:port]"),
        ("`touch {marker}`\n", "2", "not a [user@]host[:port]"),
        ("-oProxyCommand=touch {marker}\n", "2", "not a [user@]host[:port]"),
        ("localhost other\n", "2", "not a [user@]host[:port]"),
        ("node1 slots=4\n", "2", "not a [user@]host[:port]: node1\\ slots=4 (DeepSpeed's and MPI's slots=N has "
                                  "no place here: launch.sh's NPROC_PER_NODE applies to every host)"),
        ("localhost\n-n\n", "2", "not a [user@]host[:port]: -n"),  # not an option of echo
        ("node1:0\n", "2", "bad port"),
        ("node1:70000\n", "2", "bad port"),
        ("node1\nnode2\nnode1:22\n", "2", "duplicate host"),
        ("localhost\n127.0.0.1\n", "2", "duplicate host: 127.0.0.1 (this machine, also on line 1)"),
        ("localhost\nLOCALHOST\n", "2", "duplicate host: LOCALHOST (this machine, also on line 1)"),
        ("local\u00a0host\n", "2", "not a [user@]host[:port]: $'local\\302\\240host'"),  # pasted
        ("localhost\n", "0", "positive integer"),
        ("localhost\n", "-1", "positive integer"),
        ("localhost\n", "two", "positive integer"),
    ],
)
def test_rejects_bad_input_before_starting_anything(tmp_path, start, hostfile, nproc, message):
    marker = tmp_path / "injected"
    path = tmp_path / "hosts.txt"
    if hostfile is not None:
        path.write_text(hostfile.format(marker=marker))
    ssh_command, ssh_called = fake_ssh(tmp_path)
    launch = run_launch(start, [path, nproc], launch_env(SSH_COMMAND=ssh_command), timeout=30, cwd=tmp_path)
    assert launch.proc.returncode == 2
    assert message in launch.err and len(launch.err.splitlines()) == 1, launch.err
    assert launch.out == ""
    assert not marker.exists() and not ssh_called.exists()
    assert not (tmp_path / "logs").exists()


def test_rejects_bad_env_file(tmp_path, start):
    env_file = tmp_path / "env"
    env_file.write_text("GOOD=1\nexport BAD=s3cret\n")
    ssh_command, ssh_called = fake_ssh(tmp_path)
    launch = run_launch(
        start, ["--env-file", env_file, REPO / "hosts.txt", "1"],
        launch_env(SSH_COMMAND=ssh_command), timeout=30, cwd=tmp_path,
    )
    assert launch.proc.returncode == 2
    assert launch.err == f"launch.sh: {env_file}:2: not KEY=VALUE (no export, no spaces around =): export BAD\n"
    assert not ssh_called.exists()


def test_env_file_values_with_quotes_or_dollars_are_warned_of(tmp_path, start):
    env_file = tmp_path / "env"  # as a Windows editor saves it: a byte-order mark, CRLF
    env_file.write_text("\ufeffPLAIN=a b\r\nQUOTED=\"a b\"\r\nEXPANDED=/opt/bin:$PATH\r\nSINGLE='s3cret'\r\n")
    launch = run_launch(start, ["--dry-run", "--env-file", env_file, REPO / "hosts.txt", "1"], launch_env(),
                        timeout=30)
    assert launch.proc.returncode == 0, launch.err
    assert launch.err == "".join(
        f"launch.sh: warning: {env_file}:{n}: {name} gets its value as written, quotes and $ included\n"
        for n, name in ((2, "QUOTED"), (3, "EXPANDED"), (4, "SINGLE")))  # and no value


def test_rejects_arguments_that_do_not_fit_in_one_ssh_command(tmp_path, start):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("node1\n")
    ssh_command, ssh_called = fake_ssh(tmp_path)
    launch = run_launch(start, [hostfile, "1", "train.py", "--note", "x" * 70000],
                        launch_env(SSH_COMMAND=ssh_command), timeout=30, cwd=tmp_path)
    assert launch.proc.returncode == 2, launch.err
    assert launch.err == ("launch.sh: the arguments for train.py take 70012 bytes quoted; at most "
                          "65536 fit: put them in a file\n")
    assert not ssh_called.exists()


def test_unreachable_host_fails_preflight_within_connect_timeout(cluster, tmp_path, start):
    hostfile = cluster.write_hostfile(
        tmp_path / "hosts.txt", [*cluster.hosts[:2], cluster.unreachable_address]
    )
    began = time.monotonic()
    launch = run_launch(
        start, ["--log-dir", tmp_path / "logs", hostfile, "1", *TRAIN], launch_env(cluster), timeout=30
    )
    assert launch.proc.returncode == 1
    assert time.monotonic() - began < 15  # ssh's ConnectTimeout of 5 s, not preflight's 30 s
    assert "preflight failed, nothing was started" in launch.err
    failed = launch.err.splitlines()[1:]
    assert len(failed) == 1 and cluster.unreachable_address in failed[0], launch.err
    assert "timed out" in failed[0] or "No route" in failed[0], launch.err
    assert not (tmp_path / "logs").exists()
    assert not cluster.wait_until_idle(0)


@pytest.mark.parametrize("user, known_hosts, failure, hint", [
    ("nobody@", None, "Permission denied (publickey",
     "('{setup_ssh}' '{hostfile}' installs your key; one with a passphrase needs ssh-add first)"),
    ("", "empty", "Host key verification failed.",
     "('{setup_ssh}' '{hostfile}' records a new host's key)"),
    # As ssh checks it: under the address that the ssh config's HostName gives node1.
    ("", "another host's key", "Host key verification failed.",
     "(its key changed since it was recorded: find out why, then ssh-keygen -f "
     '"{known_hosts}" -R "{address}")'),
    # sshd's reason, not ssh's last line, "Disconnected from ..."
    ("", None, "Received disconnect from {address} port 22:2: Too many authentication failures",
     "(ssh offers other keys first, ssh-agent's say, more than the host takes: give these hosts "
     "'IdentityFile KEY' and 'IdentitiesOnly yes' in ~/.ssh/config)"),
], ids=["user_unknown_there", "host_key_unknown", "host_key_changed", "too_many_keys"])
def test_ssh_refusals_in_preflight_say_what_to_do(cluster, tmp_path, start, user, known_hosts,
                                                  failure, hint):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{user}node1\n")
    ssh_command = cluster.ssh_command
    if "Too many" in failure:
        ssh_command += "".join(f" -i {key}" for key in keys_no_host_knows(tmp_path))
    if known_hosts:
        node1, node2 = (line.split(" ", 1) for line in cluster.known_hosts.read_text().splitlines()[:2])
        lines = {"empty": "", "another host's key": f"{node1[0]} {node2[1]}\n"}
        (tmp_path / "known_hosts").write_text(lines[known_hosts])
        ssh_command += f" -o UserKnownHostsFile={tmp_path / 'known_hosts'}"
    launch = run_launch(start, [hostfile, "1", *TRAIN], launch_env(cluster, SSH_COMMAND=ssh_command),
                        timeout=30)
    assert launch.proc.returncode == 1
    head, row = launch.err.splitlines()
    assert head == "launch.sh: preflight failed, nothing was started:", launch.err
    assert row.startswith(f"  {user}node1  ") and failure.format(address=cluster.address("node1")) in row, launch.err
    assert row.endswith(" " + hint.format(setup_ssh=REPO / "setup_ssh.sh", hostfile=hostfile,
                                          known_hosts=tmp_path / "known_hosts",
                                          address=cluster.address("node1"))), launch.err


@contextlib.contextmanager
def firewall_on_the_rendezvous_port(cluster, verdict):
    """An nft rule on node1: `verdict` for what reaches port 29555 from the bridge."""
    if not shutil.which("nft"):
        skip_or_fail("nft not installed (apt-get install nftables)")
    table = ["inet", "launch_test"]
    for rule in (["add", "table", *table],
                 ["add", "chain", *table, "input", "{ type filter hook input priority 0; }"],
                 ["add", "rule", *table, "input", "iifname", "eth0", "tcp", "dport", "29555", *verdict]):
        cluster.run("node1", ["nft", *rule], check=True, timeout=10)
    try:
        yield
    finally:
        cluster.run("node1", ["nft", "delete", "table", *table], check=True, timeout=10)


def unreachable_rendezvous_line(cluster, error, seconds):
    """A pattern for node2's line about the rendezvous, as it prints it."""
    return (rf"node2: launch.sh: this host cannot reach the rendezvous at "
            rf"{re.escape(cluster.address('node1'))}:29555, on the first host \({error}, for {seconds} s\): ")


@pytest.mark.parametrize("verdict, error", [
    (["drop"], "timed out"),  # as cloud firewalls do
    (["reject", "with", "icmp", "type", "host-prohibited"], "No route to host"),  # as firewalld does
], ids=["drop", "reject"])
def test_a_host_cut_off_from_the_rendezvous_fails_in_one_line(cluster, tmp_path, start, verdict, error):
    """A firewall on the first host stops the others' packets to the rendezvous port:
    torchrun there would wait 60 s for its store, then fail in a traceback."""
    with firewall_on_the_rendezvous_port(cluster, verdict):
        hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:2])
        began = time.monotonic()
        launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--port", "29555", hostfile, "1",
                                    *TRAIN], launch_env(cluster), timeout=60)
        assert launch.proc.returncode == 1, launch.err
        assert time.monotonic() - began < 15 + 15  # the probe's 15 s, plus slack
        assert re.search("^  " + unreachable_rendezvous_line(cluster, error, 15), launch.err, re.M), launch.err
        assert "Traceback" not in launch.out + launch.err
    assert_nothing_left(cluster, launch)


def test_a_host_refused_by_the_rendezvous_says_so_and_tries_on(cluster, tmp_path, start):
    """Refused, as by a first host whose torchrun is not listening yet: torchrun starts at
    once, and after 30 s of refusals the host says why while torchrun tries on (for 100 s
    or more, then a traceback; test_a_failed_host_shows_launch_shs_lines_above_the_end
    checks that the summary shows the line)."""
    with firewall_on_the_rendezvous_port(cluster, ["reject", "with", "tcp", "reset"]):
        hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:2])
        launch = start(["--log-dir", tmp_path / "logs", "--port", "29555", hostfile, "1", *TRAIN],
                       launch_env(cluster))
        launch.wait_for_output("^" + unreachable_rendezvous_line(cluster, "Connection refused", 30), 60)
        assert any(argv[1].endswith("/torchrun") for _, argv in cluster.processes("node2") if len(argv) > 1)
        os.kill(launch.pid, signal.SIGTERM)
        assert launch.wait(15) == 143, launch.err
    assert_nothing_left(cluster, launch)


def test_preflight_names_every_failing_host(cluster, tmp_path, start):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt")
    launch = run_launch(
        start, ["--torchrun", "/no/such/torchrun", hostfile, "1", *TRAIN], launch_env(cluster), timeout=30
    )
    assert launch.proc.returncode == 1
    for host in cluster.hosts:
        assert re.search(rf"^  {host} +no torchrun at /no/such/torchrun$", launch.err, re.M), launch.err


def test_preflight_says_where_the_script_is_missing(tmp_path, start):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    launch = run_launch(start, ["--dry-run", hostfile, "1"], launch_env(), timeout=30, cwd=tmp_path)
    assert launch.proc.returncode == 1
    assert launch.err.endswith(f"  localhost  no train.py in {tmp_path} (cd to it, or see --workdir)\n"), \
        launch.err


def test_preflight_says_where_nproc_gpu_finds_no_gpu(tmp_path, start):
    """torchrun's own answer is two tracebacks, after the hosts have started."""
    nvidia_on_pci = [vendor for vendor in Path("/sys/bus/pci/devices").glob("*/vendor")
                     if vendor.read_text().strip() == "0x10de"
                     and (vendor.parent / "class").read_text().startswith("0x03")]
    if nvidia_on_pci or any(path for name in ("nvidia[0-9]*", "nvhost-ctrl-gpu", "kfd", "dxg")
                            for path in Path("/dev").glob(name)):
        pytest.skip("this machine has a GPU")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    launch = run_launch(start, [hostfile, "gpu", *TRAIN], launch_env(), timeout=30)
    assert launch.proc.returncode == 1
    assert launch.err == ("launch.sh: preflight failed, nothing was started:\n"
                          "  localhost  NPROC_PER_NODE is gpu, but this host has no GPU (no /dev/nvidia0, none "
                          "on its PCI bus): give a number of processes per host instead, to train on the CPUs\n"), \
        launch.err


def test_a_relative_workdir_is_taken_from_here(tmp_path, start):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    launch = run_launch(start, ["--dry-run", "--workdir", "tests", hostfile, "1", "dist_probe.py"],
                        launch_env(), timeout=30)
    assert launch.proc.returncode == 0, launch.err
    assert f"localhost (local): cd '{REPO / 'tests'}' && " in launch.out


def test_localhost_runs_without_ssh(tmp_path, start, train):
    ssh_command, ssh_called = fake_ssh(tmp_path)
    launch = run_launch(
        start,
        ["--log-dir", tmp_path / "logs", "hosts.txt", "2", *train, "--epochs", "1", "--max-steps", "4"],
        launch_env(SSH_COMMAND=ssh_command),
    )
    assert launch.proc.returncode == 0, launch.out + launch.err
    assert re.search(r"^localhost: start: world_size=2 ", launch.out, re.M)
    assert not ssh_called.exists()
    assert (tmp_path / "logs" / launch.job_id() / "localhost.log").read_text()
    assert not job_processes(launch)


@pytest.mark.parametrize("redirect", [">/dev/full", ">/dev/full 2>&1", "| head -c 0"],
                         ids=["stdout_full", "both_full", "reader_gone"])
def test_its_output_lost_fails_no_host(tmp_path, redirect):
    """As with `> out.log 2>&1` on a full disk (every write fails, ENOSPC), or `| head`."""
    torchrun = stand_in_torchrun(tmp_path, "seq 20000")  # more than a pipe holds, then success
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    result = run(["bash", "-c", f'"$0" "$@" {redirect}; exit "${{PIPESTATUS[0]}}"', LAUNCH,
                  "--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile, "1", *TRAIN],
                 env=launch_env(), cwd=REPO)
    assert result.returncode == 0, result.stderr
    [log] = (tmp_path / "logs").glob("*/localhost.log")
    assert log.read_text().splitlines() == [str(i) for i in range(1, 20001)]  # every line


@pytest.mark.parametrize("hosts", [["localhost", "node1"], ["node1", "localhost"]])
def test_local_and_remote_hosts_train_together(cluster, tmp_path, start, train, hosts):
    """A local host serves or joins the rendezvous at the address the others see."""
    launch = run_launch(
        start,
        ["--log-dir", tmp_path / "logs", cluster.write_hostfile(tmp_path / "hosts.txt", hosts), "1",
         *train, "--epochs", "1", "--max-steps", "4"],
        launch_env(cluster),
    )
    assert launch.proc.returncode == 0, launch.out + launch.err
    for host in hosts:  # (only rank 0 prints, and torchrun's own output varies by version)
        assert re.search(rf"^  {host} +0 ", launch.err, re.M), f"{host} not in the summary"
    assert re.search(r"^(localhost|node1): start: world_size=2 backend=gloo", launch.out, re.M)
    assert_nothing_left(cluster, launch)
    assert not job_processes(launch)


def test_fail_fast_when_a_worker_dies(cluster, tmp_path, start, train):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:2])
    launch = start(["--log-dir", tmp_path / "logs", hostfile, "1", *train, *UNTIL_STOPPED], launch_env(cluster))
    launch.wait_for_output(r"^node\d: epoch 1/1000 step 5/")
    (victim,) = workers(cluster, "node2")
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    assert launch.wait(30) == 1
    assert time.monotonic() - killed < 30
    assert re.search(r"^launch.sh: node2 failed first \(exit 1\); the end of its log:\n  node2: ",
                     launch.err, re.M), launch.err
    assert_nothing_left(cluster, launch)


def test_a_host_that_lost_the_store_points_to_the_first_hosts_log(cluster, tmp_path, start):
    """The first host's job fails, and its torchrun, home of the rendezvous store, takes its
    time to end (here: a process holds its output, which launch.sh gives up on after 1 s).
    The other host's torchrun fails at once for want of the store, and ends first."""
    ended = tmp_path / "first-host-ended"
    torchrun = stand_in_torchrun(tmp_path, f"""case "$*" in
  *is_host=1*) echo 'ValueError: the cause'; env -u LAUNCH_JOB sleep 3 & touch {ended}; exit 1 ;;
  *) until [ -e {ended} ]; do sleep 0.05; done
    echo 'torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection'; exit 1 ;;
esac""")
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", "node2"])
    launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile, "1", *TRAIN],
                        launch_env(cluster), timeout=30)
    assert launch.proc.returncode == 1
    assert re.search(r"^  node1  1 +\d+\n  node2  1 +\d+\n", launch.err, re.M), launch.err  # neither stopped
    assert launch.err.endswith(
        "launch.sh: node2 failed first (exit 1): its torchrun lost the rendezvous store, which node1's serves; "
        "node1 ended by itself (exit 1), and the end of its log may say why:\n  node1: ValueError: the cause\n"
    ), launch.err


def test_a_failed_host_shows_launch_shs_lines_above_the_end(tmp_path, start):
    """What launch.sh's code on a host said, 30 lines and more before the end of its log,
    still shows in the summary."""
    torchrun = stand_in_torchrun(tmp_path, "echo 'launch.sh: a word from the host'\nseq 40\nexit 1")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile,
                                "1", *TRAIN], launch_env(), timeout=30)
    assert launch.proc.returncode == 1
    assert launch.err.endswith("the end of its log:\n  localhost: launch.sh: a word from the host\n"
                               + "".join(f"  localhost: {n}\n" for n in range(21, 41))), launch.err


def test_a_failed_host_shows_the_workers_error_not_torchruns_report(tmp_path, start):
    """torchrun ends a failed job with a traceback and a report of its own, 40 lines or
    more; the summary shows what came before them, where the workers' error is."""
    torchrun = stand_in_torchrun(tmp_path, "echo 'train.py: error: the cause'\n"
                                 "echo 'Traceback (most recent call last):'\nseq 30\n"
                                 "echo 'torch.distributed.elastic.multiprocessing.errors.ChildFailedError:'\n"
                                 "seq 25\nexit 1")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile,
                                "1", *TRAIN], launch_env(), timeout=30)
    assert launch.proc.returncode == 1
    assert launch.err.endswith("the end of its log:\n  localhost: train.py: error: the cause\n"), launch.err


def start_a_sleeping_job(tmp_path, start, host="localhost", env=None):
    """launch.sh on host with a torchrun that says "started" and sleeps; once it has. env:
    launch.sh's environment (default: launch_env())."""
    torchrun = stand_in_torchrun(tmp_path, "echo started\nexec sleep 600")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{host}\n")
    launch = start(["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile, "1", *TRAIN],
                   env or launch_env())
    launch.wait_for_output(rf"^{host}: started$", timeout=30)
    return launch


def test_a_killed_torchrun_is_told_in_one_line(tmp_path, start):
    launch = start_a_sleeping_job(tmp_path, start)
    (victim,) = [pid for pid in job_processes(launch) if Path(f"/proc/{pid}/comm").read_text() == "sleep\n"]
    os.kill(victim, signal.SIGKILL)  # as the OOM killer would
    assert launch.wait(10) == 1
    # Not bash's own report, four lines of run_node's source that begin "environment: line".
    assert launch.err.endswith("  localhost: started\n"
                               "  localhost: launch.sh: torchrun was killed by SIGKILL (status 137)\n"), launch.err


def test_a_process_left_holding_the_output_keeps_no_host_waiting(tmp_path, start):
    """A process of the job that the clean-up cannot end (one that dropped the mark, as here,
    or one stuck in the kernel, which no signal ends) still holds the job's output: the
    host's part ends regardless, and launch.sh with it."""
    orphan = tmp_path / "orphan.pid"
    torchrun = stand_in_torchrun(tmp_path, f"env -u LAUNCH_JOB sleep 60 &\necho $! > {orphan}\n"
                                           "echo 'worker failed'\nexit 1")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    try:
        began = time.monotonic()
        launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile, "1",
                                    *TRAIN], launch_env(), timeout=30)
        assert launch.proc.returncode == 1, launch.err
        assert time.monotonic() - began < 20  # not the orphan's 60 s
        assert "localhost: worker failed" in launch.out, launch.out
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(orphan.read_text()), signal.SIGKILL)


def process_state(pid):
    fields = stat_fields(pid)
    return fields[0] if fields else None


def run_node_with_its_reader(launch):
    """The pid of a local node's run_node once it has forked its stdin reader, else None:
    the bash of the job whose child is a bash of the job."""
    parents = {}
    for pid in job_processes(launch):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text() == "bash\n" and (fields := stat_fields(pid)):
                parents[pid] = int(fields[1])
    return next((parent for parent in parents.values() if parent in parents), None)


def test_a_killed_host_shell_leaves_nothing_behind(tmp_path, start):
    """A kill -9 of a host's own bash (run_node), not of torchrun: the job still ends when
    launch.sh stops it, and launch.sh is not left waiting for it."""
    launch = start_a_sleeping_job(tmp_path, start)
    deadline = time.monotonic() + 10
    while not (run_node := run_node_with_its_reader(launch)) and time.monotonic() < deadline:
        time.sleep(0.1)  # run_node starts its stdin reader after torchrun
    assert run_node, "no run_node with its stdin reader"
    os.kill(run_node, signal.SIGKILL)
    while time.monotonic() < deadline and process_state(run_node) not in (None, "Z"):
        time.sleep(0.05)  # a SIGKILL takes effect when the process next runs
    os.kill(launch.pid, signal.SIGTERM)
    assert launch.wait(15) == 143, launch.err
    deadline = time.monotonic() + 10
    while job_processes(launch) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not job_processes(launch)


def test_a_directory_given_for_a_file_is_named_as_one(tmp_path, start):
    for args in ([tmp_path, "1"], ["--env-file", tmp_path, REPO / "hosts.txt", "1"]):
        launch = run_launch(start, args, launch_env(), timeout=30, cwd=tmp_path)
        assert launch.proc.returncode == 2
        assert launch.err == f"launch.sh: {tmp_path}: is a directory\n"


def require_faketime():
    if FAKETIME_LIBRARY is None:
        skip_or_fail("libfaketime not installed (apt-get install faketime)")


def faked_wall_clock(offset_file):
    """Environment under which a program's wall clock runs ahead by the seconds written in
    offset_file, which starts at 0 (libfaketime; bash sees a change up to 10 s late); its
    monotonic clock stays true, as NTP leaves it."""
    require_faketime()
    offset_file.write_text("+0\n")
    return {"LD_PRELOAD": str(FAKETIME_LIBRARY), "FAKETIME_TIMESTAMP_FILE": str(offset_file),
            "FAKETIME_NO_CACHE": "1", "DONT_FAKE_MONOTONIC": "1"}


def test_wall_clock_steps_stop_no_job(cluster, tmp_path, start):
    """NTP may step the wall clock as a job runs: here back (bash's SECONDS with it), and
    forward on a host (where bash's read -t checks its deadline). libfaketime reaches a bash
    only when the process that started it ran under libfaketime too (measured on
    2026-12-06: 0 runs in 20 otherwise): launch.sh starts through env, and on the host the
    login shell's bash, a function of its .bashrc, does."""
    here, there = tmp_path / "offset-here", tmp_path / "offset-node1"
    bashrc = cluster.host("node1").dir / "home" / ".bashrc"  # read by bash for ssh commands
    faked = " ".join(f"{k}={v}" for k, v in faked_wall_clock(there).items())
    bashrc.write_text(f'bash() {{ {faked} env bash "$@"; }}\n')
    try:
        launch = start_a_sleeping_job(tmp_path, start, "node1",
                                      launch_env(cluster, **faked_wall_clock(here)))
        here.write_text("-120\n")
        there.write_text("+120\n")
        # A bash started as run_node's is, there, must see the step, or this tests nothing.
        host_bash = [*cluster.ssh_command.split(), "node1", "bash -c 'echo $EPOCHSECONDS'"]
        host_ahead = 0
        # launch.sh's SILENCE_SECONDS, libfaketime's delay in bash, and a heartbeat
        deadline = time.monotonic() + 30 + 10 + 8
        while time.monotonic() < deadline:
            assert launch.proc.poll() is None, launch.out + launch.err
            if host_ahead < 100:
                shown = subprocess.run(host_bash, capture_output=True, text=True, timeout=10).stdout
                host_ahead = int(shown or 0) - time.time()
            time.sleep(0.5)
        assert host_ahead > 100, "node1's bash never saw its clock step forward"
    finally:
        bashrc.unlink()
    os.kill(launch.pid, signal.SIGTERM)
    assert launch.wait(15) == 143, launch.err
    assert_nothing_left(cluster, launch)


def test_a_stop_shorter_than_the_silence_stops_no_job(tmp_path, start):
    """launch.sh stopped (Ctrl-Z) for 27 s, under the hosts' 30 s of silence: once resumed,
    it writes to them at once, not at its next heartbeat."""
    launch = start_a_sleeping_job(tmp_path, start)
    os.kill(launch.pid, signal.SIGSTOP)
    time.sleep(27)
    os.kill(launch.pid, signal.SIGCONT)
    time.sleep(6)  # past 30 s of silence, and a heartbeat of 5 s more
    assert launch.proc.poll() is None, launch.out + launch.err
    os.kill(launch.pid, signal.SIGTERM)
    assert launch.wait(15) == 143, launch.err
    assert not job_processes(launch)


@pytest.mark.parametrize("cut", ["reset", "silent"])
def test_losing_a_host_stops_the_job_everywhere(cluster, tmp_path, start, train, cut):
    """node2's SSH connection dies, with a reset (its sshd killed) or silently (its link
    down: no packet passes, and only launch.sh's heartbeat going quiet tells node2)."""
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:2])
    launch = start(["--log-dir", tmp_path / "logs", hostfile, "1", *train, *UNTIL_STOPPED], launch_env(cluster))
    launch.wait_for_output(r"^node\d: epoch 1/1000 step 5/")
    link = f"{cluster.host('node2').netns}v"  # its end on the bridge

    def job_on_node2():  # all but sshd: a silent cut leaves its session to TCP's retries
        return [(pid, argv) for pid, argv in cluster.processes("node2")
                if not argv or not argv[0].startswith("sshd")]  # (a zombie has no argv)
    try:
        if cut == "reset":
            for pid, argv in cluster.processes("node2"):
                if argv and argv[0].startswith("sshd"):
                    os.kill(pid, signal.SIGKILL)
        else:
            subprocess.run(["ip", "link", "set", link, "down"], check=True)
        assert launch.wait(40) == 1, launch.err  # ssh's keep-alive gives up after 15 s
        assert re.search(r"^launch.sh: node2 failed first \(exit 255: ssh lost the connection",
                         launch.err, re.M), launch.err
        deadline = time.monotonic() + 50  # 30 s of silence, then 5 s for SIGTERM
        while job_on_node2() and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not job_on_node2()
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    cluster.kill_all("node2")  # the sshd session, if it lingers
    assert_nothing_left(cluster, launch)


def test_sigterm_stops_every_host(cluster, tmp_path, start, train):
    """(A SIGINT: test_ctrl_c_to_the_whole_group_stops_a_local_host.)"""
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:2])
    launch = start(["--log-dir", tmp_path / "logs", hostfile, "1", *train, *UNTIL_STOPPED], launch_env(cluster))
    launch.wait_for_output(r"^node\d: epoch 1/1000 step 5/")
    os.kill(launch.pid, signal.SIGTERM)
    assert launch.wait(15) == 143, launch.err
    # torchrun, sent a SIGTERM, would say "Received 15 death signal", and at times add a
    # traceback. (A worker may print one, cut off by a host that stopped first.)
    assert "death signal" not in launch.out and "SignalException" not in launch.out, launch.out
    assert "lost a peer" not in launch.out, launch.out  # a rank whose peer was stopped first
    assert_nothing_left(cluster, launch)


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGHUP, 129)], ids=["INT", "HUP"])
def test_ctrl_c_to_the_whole_group_stops_a_local_host(cluster, tmp_path, start, train, signum, status):
    """A terminal's Ctrl-C, or its SIGHUP as it closes, reaches every process of launch.sh's
    group. The local node runs in a session of its own, as a remote one does, and launch.sh
    stops it, and ends with its summary."""
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["localhost", "node1"])
    launch = start(["--log-dir", tmp_path / "logs", hostfile, "1", *train, *UNTIL_STOPPED], launch_env(cluster))
    launch.wait_for_output(r"^(localhost|node1): epoch 1/1000 step 5/")  # rank 0 on either
    os.killpg(launch.pid, signum)
    assert launch.wait(15) == status, launch.err
    assert re.search(r"^  localhost +143 .*stopped by launch.sh", launch.err, re.M), launch.err
    assert "KeyboardInterrupt" not in launch.out  # torchrun passes a SIGINT on to its workers
    assert "lost a peer" not in launch.out, launch.out  # a rank whose peer was stopped first
    assert_nothing_left(cluster, launch)
    assert not job_processes(launch)


@pytest.mark.parametrize("route", ["direct", "bastion"])
def test_ctrl_c_to_the_whole_group_stops_hosts_reached_through_a_control_master(cluster, tmp_path, start, route):
    """An ssh client that shares a ControlMaster's connection catches a Ctrl-C even where it
    is ignored, and would end at once, with the host's job left running (behind a bastion,
    until it heard nothing from launch.sh for 30 s). Out of reach of the terminal's Ctrl-C,
    the clients stay, and launch.sh stops the hosts."""
    masters, behind = (["node1", "node2"], []) if route == "direct" else (["node3"], ["node1", "node2"])
    torchrun = stand_in_torchrun(tmp_path, "echo started; sleep 600")
    with cluster.ssh_through_control_masters(tmp_path / "ssh_config", masters, behind) as ssh:
        launch = start(["--log-dir", tmp_path / "logs", "--torchrun", torchrun,
                        cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", "node2"]), "1", *TRAIN],
                       launch_env(cluster, SSH_COMMAND=ssh))
        launch.wait_for_output(r"^node1: started\n(.*\n)*node2: started$|^node2: started\n(.*\n)*node1: started$")
        os.killpg(launch.pid, signal.SIGINT)
        assert launch.wait(15) == 130, launch.err
        for host in ["node1", "node2"]:
            assert re.search(rf"^  {host} +143 .*stopped by launch.sh", launch.err, re.M), launch.err
        deadline = time.monotonic() + 10  # (a host stops in 6 s at most)
        while left := [argv for host in cluster.hosts for _, argv in cluster.processes(host)
                       if argv and not argv[0].startswith("sshd: ")]:  # the masters' sessions stay (a zombie: no argv)
            assert time.monotonic() < deadline, f"left running: {left}"
            time.sleep(0.2)


def test_dead_man_switch_when_launcher_is_killed(cluster, tmp_path, start, train):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:2])
    env_file = tmp_path / "env"
    env_file.write_text("PATH=/venv/bin:$PATH\n")  # taken as written: no tool of the clean-up is on it
    launch = start(["--log-dir", tmp_path / "logs", "--env-file", env_file, hostfile, "1", *train, *UNTIL_STOPPED],
                   launch_env(cluster))
    launch.wait_for_output(r"^node\d: epoch 1/1000 step 5/")
    os.kill(launch.pid, signal.SIGKILL)
    launch.proc.wait()
    assert_nothing_left(cluster, launch)


def test_restart_resumes_exactly(cluster, tmp_path, start):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:2])
    steps = [*TRAIN, "--epochs", "1", "--max-steps", "120", "--save-every", "20", "--log-every", "20"]
    reference = run_launch(
        start,
        ["--log-dir", tmp_path / "logs", hostfile, "1", *steps, "--checkpoint-dir", tmp_path / "a"],
        launch_env(cluster),
    )
    assert reference.proc.returncode == 0, reference.out + reference.err

    launch = start(
        ["--log-dir", tmp_path / "logs", "--max-restarts", "1", hostfile, "1", *steps,
         "--checkpoint-dir", tmp_path / "b"],
        launch_env(cluster),
    )
    launch.wait_for_output(r"^node\d: epoch 1/1 step 40/")
    (victim,) = workers(cluster, "node2")
    os.kill(victim, signal.SIGKILL)
    assert launch.wait(120) == 0, launch.out + launch.err
    assert re.search(r"^node2: torchrun on node2 restarted its workers after failures there: "
                     r"1 of at most 1 restarts used$", launch.out, re.M), launch.out
    assert re.search(r"^node\d: resumed from .* step [1-9]", launch.out, re.M), launch.out
    expected = load(tmp_path / "a" / "last.pt")["model"]
    actual = load(tmp_path / "b" / "last.pt")["model"]
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    assert_nothing_left(cluster, launch)


def test_shellcheck():
    if not shutil.which("shellcheck"):
        skip_or_fail("shellcheck not installed")
    result = subprocess.run(["shellcheck", "-x", *SHELL_SCRIPTS], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stdout


# What bash added after 4.4 (the version launch.sh and setup_ssh.sh require, RHEL 8's)
# that a script is likely to use: only bash 5.2 is here to run the tests, so a construct
# from these would pass them. A list, so it catches these and nothing else.
NEWER_THAN_BASH_4_4 = {
    r"\bwait(\s+-\w+)*\s+-\w*p": "wait -p (5.1)",
    r"\bwait(\s+-\w+)*\s+-\w*f": "wait -f (5.0)",
    r"\bwait\s+-n\s+[\"$%0-9]": "wait -n ID (5.1: 4.4 ignores the ID and waits for any job)",
    r"\b(localvar_inherit|localvar_unset|assoc_expand_once|noexpand_translation|"
    r"patsub_replacement|varredir_close|globskipdots)\b": "a shopt option of bash 5",
    r"\bEPOCH(SECONDS|REALTIME)\b": "$EPOCHSECONDS, $EPOCHREALTIME (5.0)",
    r"\bSRANDOM\b": "$SRANDOM (5.1)",
    r"\bBASH_ARGV0\b": "$BASH_ARGV0 (5.0)",
    r"@[ULuKk]\}": "${var@U} and kin (5.1, 5.2)",
}


def test_scripts_use_nothing_newer_than_bash_4_4():
    for script in SHELL_SCRIPTS:
        code = [line for line in (REPO / script).read_text().splitlines()
                if not line.lstrip().startswith("#")]
        found = [(line.strip(), what) for line in code
                 for pattern, what in NEWER_THAN_BASH_4_4.items() if re.search(pattern, line)]
        assert found == [], script


@pytest.mark.parametrize("script", ["launch.sh", "setup_ssh.sh"])
def test_help_through_a_symlink(tmp_path, script):
    (tmp_path / script).symlink_to(REPO / script)  # as in ~/bin, away from lib/
    result = subprocess.run([tmp_path / script, "--help"], capture_output=True, text=True,
                            timeout=30, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"Usage: {script} ")


@pytest.mark.parametrize("script", ["launch.sh", "setup_ssh.sh"])
def test_run_with_sh_says_to_use_bash(script):
    result = subprocess.run(["sh", REPO / script, "--help"], capture_output=True, text=True,
                            timeout=30)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"{script}: run it with bash, not sh\n"


@pytest.mark.parametrize("args, message", [
    (["--dry-run=yes", "hosts.txt", "2"], "--dry-run takes no value"),
    (["--port=", "hosts.txt", "2"], "--port needs a value"),
    (["hosts.txt", "2", "--arch", "cnn"],
     "SCRIPT comes before its arguments: launch.sh hosts.txt 2 train.py --arch ..."),
    (["hosts.txt", "2", "--dry-run"], "--dry-run is an option of launch.sh: put it before HOSTFILE"),
    (["hosts.txt", "2", "-m", "pkg.train"], "SCRIPT is a file, not -m MODULE: give a script that runs the module"),
    (["hosts.txt", "all"], "NPROC_PER_NODE must be a positive integer, or torchrun's auto, gpu or cpu: all"),
], ids=["flag_with_value", "empty_value", "script_arguments_first", "option_last", "module", "nproc"])
def test_rejects_misplaced_arguments(start, args, message):
    launch = run_launch(start, args, launch_env(), timeout=30)
    assert (launch.proc.returncode, launch.out, launch.err) == (2, "", f"launch.sh: {message}\n")


def dry_run_on_made_up_hosts(start, tmp_path, hosts, nproc):
    """launch.sh --dry-run on ssh_here's made-up hosts."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"{host}\n" for host in hosts))
    return run_launch(start, ["--dry-run", hostfile, nproc, *TRAIN], launch_env(SSH_COMMAND=ssh_here(tmp_path)),
                      timeout=30)


def test_one_host_reached_through_a_tunnel_is_fine(tmp_path, start):
    """No other host needs to reach it; and NPROC_PER_NODE may be torchrun's word."""
    launch = dry_run_on_made_up_hosts(start, tmp_path, ["tunnel"], "auto")
    assert launch.proc.returncode == 0, launch.out + launch.err
    assert "'--local-addr=127.0.0.1'" in launch.out and "'--nproc-per-node=auto'" in launch.out, launch.out


def test_preflight_rejects_addresses_the_other_hosts_cannot_use(tmp_path, start):
    launch = dry_run_on_made_up_hosts(start, tmp_path, ["fine", "box1", "box2", "tunnel", "bare"], "1")
    assert launch.proc.returncode == 1, launch.out + launch.err
    failed = dict(re.findall(r"^  (\S+) +(.*)$", launch.err, re.M))
    assert failed.keys() == {"box2", "tunnel", "bare"}, launch.err
    assert "172.17.0.2, as box1 is" in failed["box2"]
    assert "127.0.0.1 (a tunnel?)" in failed["tunnel"]
    assert "no SSH_CONNECTION" in failed["bare"]
    assert launch.out == ""


def test_a_host_whose_ssh_fails_without_a_word_is_not_called_silent(tmp_path, start):
    """As with ssh -q in SSH_COMMAND: not "no answer", which would send the user to a hang."""
    launch = dry_run_on_made_up_hosts(start, tmp_path, ["fine", "mute"], "1")
    assert launch.proc.returncode == 1, launch.out + launch.err
    assert launch.err.splitlines()[1:] == ["  mute  ssh said nothing"], launch.err


def test_a_login_that_slurm_refuses_says_why(tmp_path, start):
    """pam_slurm_adopt's refusal, a banner, shows where ssh's config says LogLevel ERROR (as
    the cluster's does)."""
    require_prerequisites()
    with simulated_cluster(2, slurm_refuses={"node2"}) as slurm:
        hostfile = slurm.write_hostfile(tmp_path / "hosts.txt")
        launch = run_launch(start, ["--dry-run", hostfile, "1", *TRAIN], launch_env(slurm), timeout=30)
    assert launch.proc.returncode == 1, launch.out + launch.err
    assert launch.err.splitlines()[1:] == [
        "  node2  Access denied by pam_slurm_adopt: you have no active jobs on this node (Slurm lets in "
        "only users with a job there: run launch.sh in an allocation of these hosts)"], launch.err


@pytest.mark.parametrize("reason", ["No such file or directory", "Permission denied"])
def test_preflight_says_why_a_host_cannot_enter_the_workdir(tmp_path, reason):
    """A directory that is there may refuse this user, as on a Kerberized NFS without a
    ticket: here one with no permission at all, and root without the capabilities that let
    it pass."""
    workdir = tmp_path / "code"
    if reason == "Permission denied":
        workdir.mkdir(mode=0)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    as_any_user = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] if os.geteuid() == 0 else []
    try:
        result = run([*as_any_user, LAUNCH, "--dry-run", "--workdir", workdir, hostfile, "1", *TRAIN],
                     timeout=30, env=launch_env())
    finally:
        if workdir.exists():
            workdir.chmod(0o700)  # for pytest to remove
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.splitlines()[1:] == [f"  localhost  cannot enter {workdir} here ({reason}): see --workdir"]


def test_a_sites_login_banner_stays_out_of_the_jobs_output(tmp_path, start):
    """ssh shows a site's login banner at LogLevel INFO, its default (which this config sets
    first, before the cluster's ERROR); the banner ends without a newline."""
    require_prerequisites()
    with simulated_cluster(1, banner="Authorized use only") as site:
        config = tmp_path / "ssh_config"
        config.write_text(f"LogLevel INFO\nInclude {site.ssh_config}\n")
        torchrun = stand_in_torchrun(tmp_path, "echo the job ran")
        launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun,
                                    site.write_hostfile(tmp_path / "hosts.txt"), "1", *TRAIN],
                            launch_env(site, SSH_COMMAND=f"ssh -F {config}"), timeout=60)
    assert launch.proc.returncode == 0, launch.out + launch.err
    assert launch.out.splitlines() == ["node1: the job ran"], launch.out
    assert "Authorized" not in launch.err, launch.err


def test_preflight_rejects_this_machine_listed_twice(tmp_path, start):
    """localhost, and a name of this machine that launch.sh cannot tell for its own
    (another network's, say): two nodes would share its GPUs."""
    addresses = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()
    if not addresses:
        skip_or_fail("this machine has no address but loopback")
    launch = dry_run_on_made_up_hosts(start, tmp_path, ["localhost", "self"], "1")
    assert launch.proc.returncode == 1, launch.out + launch.err
    assert launch.err.splitlines()[1:] == [
        f"  self       reached at {addresses[0]}, this machine's, which runs localhost already (one "
        "machine under two names?): list it once"], launch.err


def test_preflight_rejects_this_machine_where_the_hosts_see_it_at_another_address(tmp_path, start):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\nfine\n")  # fine sees this machine connect from 10.9.0.1
    launch = run_launch(
        start, ["--dry-run", hostfile, "1", *TRAIN], launch_env(SSH_COMMAND=ssh_here(tmp_path)), timeout=30
    )
    assert launch.proc.returncode == 1, launch.out + launch.err
    assert launch.err.splitlines()[1:] == [
        "  localhost  the other hosts see this machine as 10.9.0.1, which it does not hold "
        "(NAT or a jump host?): they cannot reach it there"
    ], launch.err


@pytest.mark.parametrize("hosts, problem", [
    (["fine", "behind40"], r"  behind40 +its clock is about (3[5-9]|4[0-5]) s behind fine's"),
    (["fine", "ahead40"], r"  ahead40 +its clock is about (3[5-9]|4[0-5]) s ahead of fine's"),
    # The first host's clock is the odd one: it is named, not the two that agree.
    (["behind40", "fine", "sound"], r"  behind40 +its clock is about (3[5-9]|4[0-5]) s behind fine's"),
    # 4 s from the first host's is never 4 s for certain, in whole seconds; 8 s apart is:
    (["fine", "ahead4", "behind4"], r"  ahead4 +its clock is about ([6-9]|10) s ahead of behind4's"),
], ids=["behind", "ahead", "first-host", "apart"])
def test_preflight_rejects_hosts_whose_clocks_disagree(tmp_path, start, hosts, problem):
    """torchrun's rendezvous compares the hosts' clocks, and drops a host 15 s off."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("".join(f"{host}\n" for host in hosts))
    launch = run_launch(start, ["--dry-run", hostfile, "1", *TRAIN], launch_env(SSH_COMMAND=ssh_here(tmp_path)),
                        timeout=30)
    assert launch.proc.returncode == 1, launch.out + launch.err
    assert re.fullmatch(rf"launch.sh: preflight failed, nothing was started:\n{problem}, and torchrun's "
                        r"rendezvous, .*\n", launch.err), launch.err


def test_preflight_gives_up_on_a_host_that_never_answers(tmp_path, start):
    """The first host, whose check runs alone at first, never answers: the others are
    checked after 5 s all the same. Another answers, but its session stays open."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("stuck\nfine\nlingers\n")
    began = time.monotonic()
    launch = run_launch(
        start, ["--workdir", REPO, hostfile, "1", *TRAIN], launch_env(SSH_COMMAND=ssh_here(tmp_path)),
        timeout=60, cwd=tmp_path,
    )
    assert launch.proc.returncode == 1, launch.out + launch.err
    assert 30 <= time.monotonic() - began < 40
    assert launch.err.splitlines()[1:] == [
        "  stuck    no answer within 30 s",
        "  lingers  its check passed, but its SSH session did not end within 30 s: a program that a login "
        "script starts in the background holds the session's output (start it with >/dev/null 2>&1)",
    ], launch.err
    assert not launch.processes()  # the stuck ssh is gone too, and the lingering one
    assert not (tmp_path / "logs").exists()


def test_hosts_whose_login_shell_is_fish_or_tcsh(tmp_path, start):
    """sshd runs the remote command through the login shell, and these two parse it unlike sh."""
    require_prerequisites(LOGIN_SHELLS.values())
    torchrun = stand_in_torchrun(tmp_path, 'for last; do :; done\nprintf "last=%s\\n" "$last"')
    with simulated_cluster(2, login_shells=LOGIN_SHELLS) as odd_cluster:
        launch = start(
            ["--log-dir", tmp_path / "logs", "--torchrun", torchrun,
             odd_cluster.write_hostfile(tmp_path / "hosts.txt"), "1", "tests/dist_probe.py", "--echo", ODD_ARG],
            launch_env(odd_cluster),
        )
        assert launch.wait(60) == 0, launch.out + launch.err
        assert sorted(re.findall(r"^(node\d): last=(.*)$", launch.out, re.M)) == [
            ("node1", ODD_ARG), ("node2", ODD_ARG)], launch.out
        assert_nothing_left(odd_cluster, launch)


def test_sigterm_to_the_whole_group_during_preflight_exits_143(tmp_path, start):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("fine\nstuck\n")
    launch = start(["--dry-run", hostfile, "1", *TRAIN], launch_env(SSH_COMMAND=ssh_here(tmp_path)))
    time.sleep(3)  # "fine" has answered; "stuck" never will
    os.killpg(launch.pid, signal.SIGTERM)  # as timeout(1), systemd or Slurm do: its checks die too
    assert launch.wait(10) == 143, launch.err
    assert launch.err == "launch.sh: stopped during preflight, nothing was started\n"


def stand_in_torchrun_whose_worker_saves_on_sigterm(tmp_path):
    """It prints "started"; on SIGTERM, "stopping", and a second later "stopped"."""
    worker = tmp_path / "worker.py"
    worker.write_text("import signal, sys, time\n"
                      "def stop(*_):\n"
                      "    print('stopping', flush=True); time.sleep(1); print('stopped', flush=True)\n"
                      "    sys.exit(0)\n"
                      "signal.signal(signal.SIGTERM, stop)\n"
                      "print('started', flush=True)\n"
                      "while True: time.sleep(1)\n")
    return stand_in_torchrun(tmp_path, f"{sys.executable} {worker} & wait")


def test_sigterm_to_the_whole_group_waits_for_what_the_hosts_say_as_they_stop(tmp_path, start):
    """timeout(1) sends its SIGTERM to every process of launch.sh's group, its pipelines too:
    they must live on to carry the hosts' last lines, and launch.sh must wait for the hosts
    to stop."""
    torchrun = stand_in_torchrun_whose_worker_saves_on_sigterm(tmp_path)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    launch = start(["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile, "1", *TRAIN], launch_env())
    launch.wait_for_output(r"^localhost: started$", timeout=30)
    os.killpg(launch.pid, signal.SIGTERM)
    assert launch.wait(15) == 143, launch.err
    assert launch.out.endswith("localhost: stopping\nlocalhost: stopped\n"), launch.out
    (log,) = (tmp_path / "logs").glob("*/localhost.log")
    assert log.read_text() == "started\nstopping\nstopped\n"
    assert not job_processes(launch)


def test_sigterm_to_every_process_of_the_launch_waits_for_what_a_remote_host_says(cluster, tmp_path, start):
    """systemd (and Slurm, by cgroup) send their SIGTERM to every process of the job, ssh too,
    which must live on to carry the host's last lines."""
    torchrun = stand_in_torchrun_whose_worker_saves_on_sigterm(tmp_path)
    launch = start(["--log-dir", tmp_path / "logs", "--torchrun", torchrun,
                    cluster.write_hostfile(tmp_path / "hosts.txt", ["node1"]), "1", *TRAIN], launch_env(cluster))
    launch.wait_for_output(r"^node1: started$", timeout=30)
    for pid in launch.processes():  # here, not on the host
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    assert launch.wait(15) == 143, launch.err
    assert launch.out.endswith("node1: stopping\nnode1: stopped\n"), launch.out
    assert re.search(r"^  node1 +143 .*stopped by launch.sh", launch.err, re.M), launch.err
    assert_nothing_left(cluster, launch)


def test_a_host_that_ends_at_once_is_never_a_failure(tmp_path, start):
    """Races between launch.sh and a host's pipeline starting show as failures of jobs that
    end at once (13 of 40 once, when launch.sh removed a FIFO the host had yet to open)."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    for attempt in range(15):
        launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", "/bin/true",
                                    hostfile, "1", *TRAIN], launch_env(), timeout=30)
        assert launch.proc.returncode == 0, f"attempt {attempt}: {launch.err}"
        # Not even a zombie for init to reap (which some containers' init never does).
        assert not launch.processes(), f"attempt {attempt}"


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_whole_group_while_hosts_start(tmp_path, start, signum, status):
    """A Ctrl-C or SIGTERM to the whole group as hosts start is neither lost nor fatal
    mid-start, and pipelines that die as they start must not block launch.sh."""
    hostfile = tmp_path / "hosts.txt"
    # The rendezvous on this machine, where the made-up hosts reach it: their addresses
    # lead off this machine, where no packet may go.
    hostfile.write_text("localhost\n" + "".join(f"h{i}\n" for i in range(2, 51)))
    logs = tmp_path / "logs"
    torchrun = stand_in_torchrun(tmp_path, "exit 0")
    launch = start(["--log-dir", logs, "--torchrun", torchrun, hostfile, "1", *TRAIN],
                   launch_env(SSH_COMMAND=ssh_here(tmp_path)))
    deadline = time.monotonic() + 60
    while not list(logs.glob("*/localhost.log")):  # host 0's pipeline runs; 49 more to start
        if launch.proc.poll() is not None or time.monotonic() > deadline:
            launch.kill()
            pytest.fail(f"launch.sh never started the hosts\n{launch.out}\n{launch.err}")
        time.sleep(0.005)
    os.kill(launch.pid, signal.SIGSTOP)  # in mid-loop
    os.killpg(launch.pid, signum)  # TERM: a pipeline yet to ignore it dies now
    os.kill(launch.pid, signal.SIGCONT)
    assert launch.wait(20) == status, launch.err
    assert re.search(r"HOST +EXIT", launch.err), launch.err  # the summary: it waited for the hosts


@pytest.mark.parametrize("second_ctrl_c", [True, False])
def test_a_host_that_never_ends_its_stop_is_left_with_a_word(tmp_path, start, second_ctrl_c):
    """Ctrl-C, and a host that does not end (stuck on a hung mount, say): a second Ctrl-C,
    or 30 s, ends the wait, and launch.sh leaves nothing of its own behind."""
    launch = start_a_sleeping_job(tmp_path, start, host="hung",
                                  env=launch_env(SSH_COMMAND=ssh_here(tmp_path)))
    os.killpg(launch.pid, signal.SIGINT)  # as a terminal's Ctrl-C
    stopping = time.monotonic()
    launch.wait_for_output("stopping the job on every host", timeout=10, stream="err")
    deadline = time.monotonic() + 10
    while job_processes(launch) and time.monotonic() < deadline:  # the host's part stops ...
        time.sleep(0.2)
    assert not job_processes(launch)
    assert launch.proc.poll() is None  # ... but its "ssh" never ends
    if second_ctrl_c:
        os.killpg(launch.pid, signal.SIGINT)
    second = time.monotonic()
    assert launch.wait(45) == 130, launch.err
    # launch.sh counts its 30 s in polls, each of which a loaded machine may lengthen
    waited = time.monotonic() - (second if second_ctrl_c else stopping)
    assert waited < 2 if second_ctrl_c else 29 < waited < 45, waited
    leaving = "at a second signal" if second_ctrl_c else "after 30 s of stopping"
    assert re.search(r"^  hung +- +\d+  \(left stopping\)$", launch.err, re.M), launch.err
    assert launch.err.endswith(
        f"launch.sh: left hung still stopping, {leaving}; part of the job may run on there: "
        f"'grep -lzF LAUNCH_JOB={launch.job_id()}/ /proc/*/environ' lists its processes\n"), launch.err
    deadline = time.monotonic() + 5
    while launch.processes() and time.monotonic() < deadline:
        time.sleep(0.1)  # a host's run_host ends once its programs are killed
    assert not launch.processes()  # its "ssh", tee and prefix_lines are gone
