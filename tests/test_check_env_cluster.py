"""check_env.py end to end on the simulated cluster (tests/cluster.py): real
sshd hosts in network namespaces, reached through SSH_COMMAND.

Skips without root, iproute2 or sshd, unless REQUIRE_CLUSTER_TESTS=1."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from cluster import cluster_fixture, keys_no_host_knows, require_prerequisites, simulated_cluster
from conftest import skip_or_fail
from test_check_env import ALLREDUCE_SIZES, REPO, allreduce_rows, run_check_env

cluster = cluster_fixture(n_hosts=3)

# Debian's python3, which has no torch: what a host finds when its
# non-interactive shell does not put the job's environment on PATH.
SYSTEM_PYTHON = "/usr/bin/python3"


def problem_lines(stdout):
    """The lines after 'N problem(s):'."""
    _, _, problems = stdout.partition(" problem(s):\n")
    return [line for line in problems.splitlines() if not line.startswith("all-reduce skipped")]


def test_hosts_gathers_real_reports(cluster, tmp_path):
    """(Through an ssh config that runs a command and forwards a port in use, which must not
    matter.)"""
    import torch

    # localhost is checked here without ssh, and shares the cluster's subnet through its bridge.
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["localhost", *cluster.hosts[:2]])
    with cluster.ssh_with_an_interactive_config(tmp_path / "ssh_config") as ssh:
        result = run_check_env(["--hosts", str(hostfile), "--json"], timeout=120,
                               env=cluster.env(NCCL_DEBUG="WARN", MASTER_PORT="1234", SSH_COMMAND=ssh))
    assert result.returncode == 0, result.stdout + result.stderr
    reports = json.loads(result.stdout)["hosts"]
    assert list(reports) == ["localhost", *cluster.hosts[:2]]
    assert reports.pop("localhost")["hostname"] == socket.gethostname()
    for name, report in reports.items():
        assert report["hostname"] == name  # really gathered there, not here
        assert report["clock_offset"][0] <= 0 <= report["clock_offset"][1]  # this machine's clock
        assert report["torch"] == torch.__version__
        assert {"name": "eth0", "address": f"{cluster.address(name)}/24"} in report["interfaces"]
        # Forwarded as launch.sh does (cluster.env() hides the GPUs, run() sets one thread);
        # MASTER_PORT not.
        assert report["env"] == {"NCCL_DEBUG": "WARN", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def test_one_connection_to_a_bastion_serves_every_report(cluster, tmp_path):
    """Through a bastion with a ControlMaster (as the README advises), a login to the first
    host opens the master before the others start: all at once, each would open a connection
    of its own, and more than sshd's MaxStartups (10) drop some."""
    bastion_log = cluster.host("node1").dir / "sshd.log"
    accepted_before = bastion_log.read_text().count("Accepted publickey")
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["node2", "node3"])
    with cluster.ssh_through_control_masters(tmp_path / "ssh_config", ["node1"], behind=["node2", "node3"]) as ssh:
        result = run_check_env(["--hosts", str(hostfile)], timeout=120, env=cluster.env(SSH_COMMAND=ssh))
    assert result.returncode == 0, result.stdout + result.stderr
    assert bastion_log.read_text().count("Accepted publickey") - accepted_before == 1


def test_variables_reach_hosts_whose_login_shell_is_fish_or_tcsh(tmp_path):
    """They travel on stdin, so no login shell parses them (tcsh expands "!" even in single
    quotes)."""
    shells = {"node1": "/usr/bin/fish", "node2": "/usr/bin/tcsh"}
    require_prerequisites(shells.values())
    value = "a!b 'c' \"d\" $HOME \\n"
    with simulated_cluster(2, login_shells=shells) as odd:
        result = run_check_env(["--hosts", str(odd.write_hostfile(tmp_path / "hosts.txt")), "--json"], timeout=120,
                               env=odd.env(NCCL_ODD=value))
    assert result.returncode == 0, result.stdout + result.stderr
    reports = json.loads(result.stdout)["hosts"]
    assert len(reports) == 2, reports
    for name, report in reports.items():
        assert report["env"]["NCCL_ODD"] == value, name


@contextmanager
def shell_path(cluster, hosts):
    """Make `python3` in hosts' non-interactive SSH shells this test's interpreter: its
    directory first on PATH, as a venv activated in ~/.bashrc, which bash reads for ssh
    commands, puts it (a link to a venv's python elsewhere would start it outside the venv).
    Every other host finds the system python3.
    """
    bindir = Path(sys.executable).parent
    bashrcs = [cluster.host(name).dir / "home" / ".bashrc" for name in hosts]
    try:
        for bashrc in bashrcs:
            bashrc.write_text(f'export PATH="{bindir}:$PATH"\n')
        yield bindir / "python3"
    finally:
        for bashrc in bashrcs:
            bashrc.unlink(missing_ok=True)


def test_host_whose_shell_finds_another_python_is_a_problem(cluster, tmp_path):
    if not Path(SYSTEM_PYTHON).exists():
        skip_or_fail(f"{SYSTEM_PYTHON} not installed")
    if subprocess.run([SYSTEM_PYTHON, "-c", "import torch"], capture_output=True, timeout=60).returncode == 0:
        skip_or_fail(f"{SYSTEM_PYTHON} has torch, so it cannot play the host without torch")
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt")
    with shell_path(cluster, ["node1", "node3"]) as python3:
        # Hosts as columns, however wide the paths make them.
        result = run_check_env(["--hosts", str(hostfile), "--python", "python3"], timeout=120,
                               env=cluster.env(COLUMNS="1000"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert problem_lines(result.stdout) == [
        f"node2: torch does not import: ModuleNotFoundError: No module named 'torch' (interpreter {SYSTEM_PYTHON})"
    ]
    interpreter_row = next(line for line in result.stdout.splitlines() if line.startswith("* interpreter"))
    assert interpreter_row.split()[2:] == [str(python3), SYSTEM_PYTHON, str(python3)]


def test_unreachable_host_is_a_problem(cluster, tmp_path):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", cluster.unreachable_address])
    result = run_check_env(["--hosts", str(hostfile)], timeout=60, env=cluster.env())
    assert result.returncode == 1
    [line] = problem_lines(result.stdout)
    assert line.startswith(f"{cluster.unreachable_address}: unreachable: ssh: connect to host")


@pytest.mark.parametrize("line, ssh_options, fix", [
    ("nobody@node1", "", "(setup_ssh.sh installs your key; one with a passphrase needs ssh-add first)"),
    ("node1", "-o UserKnownHostsFile=/dev/null", "(setup_ssh.sh records a new host's key)"),
    ("node1", "six keys first", "Too many authentication failures (ssh offers other keys first, ssh-agent's "
     "say, more than the host takes: give these hosts 'IdentityFile KEY' and 'IdentitiesOnly yes' in "
     "~/.ssh/config)"),
], ids=["user_unknown_there", "host_key_unknown", "too_many_keys"])
def test_a_refused_login_is_not_called_unreachable(cluster, tmp_path, line, ssh_options, fix):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{line}\n")
    if ssh_options == "six keys first":
        ssh_options = "".join(f" -i {key}" for key in keys_no_host_knows(tmp_path))
    env = cluster.env(SSH_COMMAND=f"{cluster.ssh_command} {ssh_options}")
    result = run_check_env(["--hosts", str(hostfile)], timeout=60, env=env)
    assert result.returncode == 1
    [problem] = problem_lines(result.stdout)
    assert problem.startswith(f"{line}: ssh refused the login: ") and problem.endswith(fix), problem


def test_a_login_that_slurm_refuses_says_why(tmp_path):
    """pam_slurm_adopt's refusal, a banner, shows where ssh's config says LogLevel ERROR (as
    the cluster's does)."""
    require_prerequisites()
    with simulated_cluster(1, slurm_refuses={"node1"}) as slurm:
        hostfile = slurm.write_hostfile(tmp_path / "hosts.txt")
        result = run_check_env(["--hosts", str(hostfile)], timeout=60, env=slurm.env())
    assert result.returncode == 1
    assert problem_lines(result.stdout) == [
        "node1: ssh refused the login: Access denied by pam_slurm_adopt: you have no active jobs on this "
        "node (Slurm lets in only users with a job there: run check_env.py in an allocation of these hosts)"]


@pytest.mark.parametrize("network", [{"routed": "eth0"}, {"ipv6": True}], ids=["routed", "ipv6"])
def test_allreduce_across_hosts_prints_busbw_and_leaves_nothing_running(tmp_path, network):
    """On a routed network (a /32 per host), and with hosts reached over IPv6: harder than
    the shared subnet of the other tests, whose all-reduce fails or is stopped. The first
    host, which picks the port, greets every login."""
    require_prerequisites()
    with simulated_cluster(2, **network) as other:
        (other.host(other.hosts[0]).dir / "home" / ".bashrc").write_text('echo "Welcome to $HOSTNAME"\n')
        hostfile = other.write_hostfile(tmp_path / "hosts.txt")
        result = run_check_env(["--hosts", str(hostfile), "--allreduce"], timeout=180, env=other.env())
        assert result.returncode == 0, result.stdout + result.stderr
        assert "all-reduce, float32 sum, gloo, 2 node(s), 2 ranks" in result.stdout
        rows = allreduce_rows(result.stdout)
        assert [" ".join(row[:2]) for row in rows] == ALLREDUCE_SIZES
        assert all(row[-1] == "ok" for row in rows) and float(rows[-1][4]) > 0  # busbw of 64 MiB
        assert f"busbw at 64 MiB: {rows[-1][4]} GB/s (averaged over every size" in result.stdout
        assert other.wait_until_idle(10) == {}


def test_allreduce_fails_fast_when_a_node_cannot_reach_the_rendezvous(cluster, tmp_path):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", "node2"])
    # node2 can still be reached over ssh (from the bridge), but not reach node1.
    cut = ["ip", "route", "add", "blackhole", f"{cluster.address('node1')}/32"]
    cluster.run("node2", cut, check=True, timeout=10)
    try:
        result = run_check_env(["--hosts", str(hostfile), "--allreduce"], timeout=120, env=cluster.env())
    finally:
        cluster.run("node2", ["ip", "route", "del", *cut[3:]], check=True, timeout=10)
    assert result.returncode == 1
    assert f"node2: cannot reach the rendezvous at {cluster.address('node1')}:" in result.stdout
    assert cluster.wait_until_idle(10) == {}


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_stopping_check_env_during_allreduce_stops_every_node(cluster, tmp_path, stop_signal):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", "node2"])
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "check_env.py"), "--hosts", str(hostfile), "--allreduce"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=cluster.env(),
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not any("torch.distributed.run" in argv for _, argv in cluster.processes("node2")):
            assert proc.poll() is None and time.monotonic() < deadline, "torchrun never started on node2"
            time.sleep(0.2)
        proc.send_signal(stop_signal)  # the process only: its ssh clients are in sessions of their own
        # SIGTERM: it stops the nodes, waiting up to NODE_STOP_S (10 s) for them.
        assert proc.wait(timeout=15) == (143 if stop_signal == signal.SIGTERM else -signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Either way each node's stdin ended, and its check_env.py --run-node stopped torchrun.
    assert cluster.wait_until_idle(10) == {}
