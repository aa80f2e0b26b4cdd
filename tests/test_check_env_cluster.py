"""check_env.py end to end on the simulated cluster (tests/cluster.py): real sshd hosts in
network namespaces, reached through SSH_COMMAND, and --allreduce through launch.sh.

Skips without root, iproute2 or sshd, unless REQUIRE_CLUSTER_TESTS=1."""

import json
import subprocess
import sys
import time
from pathlib import Path

from cluster import cluster_fixture, require_prerequisites, simulated_cluster
from conftest import REPO, skip_or_fail
from test_check_env import ALLREDUCE_SIZES, allreduce_rows, run_check_env

cluster = cluster_fixture(n_hosts=3)

# Debian's python3, which has no torch: what a host finds when its non-interactive shell does
# not put the job's environment on PATH.
SYSTEM_PYTHON = "/usr/bin/python3"


def problem_lines(stdout):
    return stdout.partition(" problem(s):\n")[2].splitlines()


def test_hosts_compares_real_reports_and_names_the_host_that_differs(cluster, tmp_path):
    """node1 and node3 find this test's python3 on PATH (a venv activated in ~/.bashrc),
    node2 Debian's, without torch. Through an ssh config that runs a command of its own
    and forwards a port in use, which must not matter."""
    import torch

    if subprocess.run([SYSTEM_PYTHON, "-c", "import torch"], capture_output=True, timeout=60).returncode == 0:
        skip_or_fail(f"{SYSTEM_PYTHON} has torch, so it cannot play the host without torch")
    bindir = Path(sys.executable).parent
    bashrcs = [cluster.host(name).dir / "home" / ".bashrc" for name in ("node1", "node3")]
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt")
    try:
        for bashrc in bashrcs:
            bashrc.write_text(f'export PATH="{bindir}:$PATH"\n')
        with cluster.ssh_with_an_interactive_config(tmp_path / "ssh_config") as ssh:
            result = run_check_env(["--hosts", hostfile, "--python", "python3", "--json"], timeout=120,
                                   env=cluster.env(SSH_COMMAND=ssh))
    finally:
        for bashrc in bashrcs:
            bashrc.unlink(missing_ok=True)
    assert result.returncode == 1, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["problems"] == [
        f"node2: torch does not import: ModuleNotFoundError: No module named 'torch' (interpreter {SYSTEM_PYTHON})"]
    for name in ("node1", "node3"):
        report = data["hosts"][name]
        assert report["hostname"] == name and report["torch"] == torch.__version__  # really gathered there
        assert report["python_executable"] == str(bindir / "python3")
        assert {"name": "eth0", "address": f"{cluster.address(name)}/24"} in report["interfaces"]
        assert report["ssh_connection"].split()[2] == cluster.address(name)
        assert report["clock_offset"][0] <= 0 <= report["clock_offset"][1]  # this machine's clock
        assert report["gloo_address"] == "127.0.1.1"  # as Debian maps the host's name


def test_unreachable_and_refusing_hosts_are_problems_not_hangs(cluster, tmp_path):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", [cluster.unreachable_address, "nobody@node1"])
    start = time.monotonic()
    result = run_check_env(["--hosts", hostfile], timeout=60, env=cluster.env())
    assert result.returncode == 1, result.stdout + result.stderr
    unreachable, refused = problem_lines(result.stdout)
    assert unreachable.startswith(f"{cluster.unreachable_address}: ssh: connect to host")
    assert refused == (f"nobody@node1: nobody@{cluster.address('node1')}: Permission denied (publickey). "
                       f"({REPO}/setup_ssh.sh {hostfile} installs your key (one with a passphrase needs ssh-add "
                       "first))")
    assert time.monotonic() - start < 30  # ssh's ConnectTimeout is 5 s


def test_a_login_that_slurm_refuses_says_why(tmp_path):
    """pam_slurm_adopt's refusal, a banner, shows where ssh's config says LogLevel ERROR (as
    the cluster's does)."""
    require_prerequisites()
    with simulated_cluster(1, slurm_refuses={"node1"}) as slurm:
        result = run_check_env(["--hosts", slurm.write_hostfile(tmp_path / "hosts.txt")], timeout=60,
                               env=slurm.env())
    assert result.returncode == 1
    assert problem_lines(result.stdout) == [
        "node1: Access denied by pam_slurm_adopt: you have no active jobs on this node (Slurm lets in only users "
        "with a job there: work in an allocation of them, or use train.sbatch)"]


def test_allreduce_across_hosts_prints_busbw_and_leaves_nothing_running(cluster, tmp_path):
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", ["node1", "node2"])
    result = run_check_env(["--hosts", hostfile, "--allreduce"], timeout=180, env=cluster.env(), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all-reduce, float32 sum, gloo, 2 node(s), 2 ranks" in result.stdout
    rows = allreduce_rows(result.stdout)
    assert [" ".join(row[:2]) for row in rows] == ALLREDUCE_SIZES
    assert all(row[-1] == "ok" for row in rows) and float(rows[-1][4]) > 0  # busbw of 64 MiB
    assert f"busbw at 64 MiB: {rows[-1][4]} GB/s (averaged over every size" in result.stdout
    assert cluster.wait_until_idle(10) == {}
