"""A simulated SLURM cluster for end-to-end tests: munged and slurmctld here, and a slurmd on
each host of a simulated_cluster (tests/cluster.py), in that host's namespaces.

    from slurm_cluster import slurm_fixture
    slurm = slurm_fixture(n_hosts=2)                       # module-scoped

    def test_job(slurm, tmp_path):
        job = slurm.sbatch(["--nodes=2", REPO / "train.sbatch", "2"], cwd=tmp_path)
        slurm.wait_for(job, "COMPLETED", timeout=60)       # its scontrol fields
        slurm.job_processes("node1")                       # what runs on node1

Each node has 2 CPUs and 4 GPUs (files: jobs ask for them as on GPU clusters, and run on the
CPU). Every daemon, file and port is the instance's own (pytest-xdist may run two). Needs
root, slurm-wlm and munge besides what tests/cluster.py needs; without them the fixture
skips, unless REQUIRE_CLUSTER_TESTS=1, when it fails.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from cluster import require_prerequisites, simulated_cluster
from conftest import HIDDEN_GPUS, skip_or_fail

COMMANDS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
OWNER = "SIMULATED_SLURM_OWNER"  # in the daemons' environment: the pid of the test process


def slurm_fixture(n_hosts=2):
    """A module-scoped pytest fixture yielding a SlurmCluster of n_hosts nodes."""

    @pytest.fixture(scope="module")
    def _slurm():
        require_prerequisites()
        missing = [name for name in COMMANDS if not shutil.which(name)]
        if missing:
            skip_or_fail(f"simulated SLURM unavailable: no {', '.join(missing)} (apt-get install slurm-wlm munge)")
        with simulated_slurm(n_hosts) as slurm:
            yield slurm

    return _slurm


class SlurmCluster:
    """Nodes node1..nodeN (cluster.hosts, a simulated_cluster), in the one partition."""

    def __init__(self, cluster, conf, slurmd_pids):
        self.cluster = cluster
        self.conf = conf
        self.nodes = cluster.hosts
        self._slurmd = slurmd_pids

    def env(self, **extra):
        """os.environ with this cluster's SLURM_CONF, one thread and no GPU (what sbatch passes
        on to every node), plus extra."""
        return {**os.environ, "SLURM_CONF": str(self.conf), "OMP_NUM_THREADS": "1", **HIDDEN_GPUS, **extra}

    def command(self, name, args):
        """args as a command run in node name's namespaces, where its jobs run."""
        return ["nsenter", "-t", str(self._slurmd[name]), "-n", "-u", "-m", "--", *map(str, args)]

    @contextlib.contextmanager
    def bind_mount(self, name, source, target):
        """source mounted on target for node name alone (its slurmd's mount namespace)."""
        subprocess.run(self.command(name, ["mount", "--bind", source, target]), check=True, timeout=30)
        try:
            yield
        finally:
            subprocess.run(self.command(name, ["umount", target]), check=True, timeout=30)

    def sbatch(self, args, cwd, **env):
        """Submit `sbatch ARGS` from cwd, with env; return the job id."""
        result = subprocess.run(["sbatch", "--parsable", *map(str, args)], cwd=cwd, env=self.env(**env),
                                capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    def job(self, job_id):
        """The fields of `scontrol show job`: JobState, Restarts, ExitCode, NumCPUs..."""
        result = subprocess.run(["scontrol", "show", "job", "--oneliner", job_id], env=self.env(),
                                capture_output=True, text=True, timeout=30, check=True)
        return dict(field.split("=", 1) for field in result.stdout.split() if "=" in field)

    def wait_for(self, job_id, state, timeout):
        """Wait until job job_id is in state; return its fields. Fails at once if it ends in
        another."""
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] != state:
            assert job["JobState"] not in ENDED, f"job {job_id} ended {job['JobState']}, not {state}"
            assert time.monotonic() < deadline, f"job {job_id} still {job['JobState']} after {timeout} s"
            time.sleep(0.2)
        return job

    def output(self, directory, job_id):
        """The text of train.sbatch's output file, train-JOBID.out in directory."""
        return (Path(directory) / f"train-{job_id}.out").read_text()

    def job_processes(self, name):
        """[(pid, argv)] of what runs on node name besides its slurmd and sshd."""
        return [(pid, argv) for pid, argv in self.cluster.processes(name) if pid != self._slurmd[name]]

    def wait_until_idle(self, timeout):
        """Wait until no node runs a job's process; return {node: processes} of what is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = {name: found for name in self.nodes if (found := self.job_processes(name))}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def cancel_all(self, timeout=30):
        """Cancel every job; wait until the nodes are idle; return what is left."""
        subprocess.run(["scancel", "--user=root"], env=self.env(), capture_output=True, timeout=30)
        return self.wait_until_idle(timeout)


@contextlib.contextmanager
def simulated_slurm(n_hosts=2):
    """n_hosts simulated hosts, each a SLURM node; everything torn down on exit."""
    _remove_stale_daemons()
    daemons = []
    with simulated_cluster(n_hosts) as cluster:
        base = cluster.dir / "slurm"
        base.mkdir()
        try:
            daemons.append(_start_munged(base))
            conf = _write_config(base, cluster)
            daemons.append(_popen(["slurmctld", "-D", "-f", conf], base / "slurmctld.out"))
            slurmd = {}
            for name in cluster.hosts:
                daemons.append(_start_slurmd(cluster.host(name), conf, base))
                slurmd[name] = daemons[-1].pid
            slurm = SlurmCluster(cluster, conf, slurmd)
            _wait_until_nodes_idle(slurm, base, timeout=30)
            yield slurm
        finally:
            for daemon in reversed(daemons):  # a node's job processes go with its namespace
                _stop(daemon)


def _popen(args, log):
    with open(log, "ab") as out:
        return subprocess.Popen([str(a) for a in args], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, OWNER: str(os.getpid())})


def _stop(daemon):
    daemon.terminate()
    try:
        daemon.wait(timeout=10)
    except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait(timeout=10)


def _remove_stale_daemons():
    """Kill the daemons of clusters whose test process is gone (killed before its teardown)."""
    mark = f"{OWNER}=".encode()
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            for owner in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"):
                if owner.startswith(mark) and not Path(f"/proc/{int(owner[len(mark):])}").exists():
                    os.kill(int(entry.name), signal.SIGKILL)


def _start_munged(base):
    """munged with a key, socket, pid and seed file of its own; --origin: no name lookup."""
    key = base / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = base / "munge.socket"
    munged = _popen(["munged", "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
                     f"--pid-file={base / 'munged.pid'}", f"--seed-file={base / 'munged.seed'}",
                     f"--log-file={base / 'munged.log'}", "--origin=127.0.0.1"], base / "munged.out")
    deadline = time.monotonic() + 30
    while not socket_path.exists():
        if munged.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"munged did not start: {(base / 'munged.log').read_text()[-2000:]}")
        time.sleep(0.05)
    return munged


def _free_port():
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _write_config(base, cluster):
    conf = base / "slurm.conf"
    conf.write_text(
        f"ClusterName=sim{os.getpid()}\n"
        f"SlurmctldHost={socket.gethostname()}({cluster.local_address})\n"
        f"SlurmctldPort={_free_port()}\nSlurmdPort=6818\nSlurmUser=root\nSlurmdUser=root\n"
        # A requeued job waits cred_expire + 1 s (by default 121 s) before it starts again.
        f"AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={base / 'munge.socket'},cred_expire=10\n"
        f"StateSaveLocation={base / 'state'}\nSlurmdSpoolDir={base / 'spool-%n'}\n"
        f"SlurmctldPidFile={base / 'slurmctld.pid'}\nSlurmdPidFile={base / 'slurmd-%n.pid'}\n"
        f"SlurmctldLogFile={base / 'slurmctld.log'}\nSlurmdLogFile={base / 'slurmd-%n.log'}\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"  # no cgroups to set up
        "JobAcctGatherType=jobacct_gather/none\nAccountingStorageType=accounting_storage/none\n"
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nSlurmdParameters=config_overrides\n"
        "JobRequeue=0\n"  # as where only the jobs that ask (--requeue) are requeued
        "SchedulerType=sched/builtin\nSchedulerParameters=sched_interval=1\n"  # a requeued job at once
        "MpiDefault=none\nReturnToService=2\nGresTypes=gpu\n"
        + "".join(f"NodeName={name} NodeAddr={cluster.address(name)} CPUs=2 RealMemory=1000 Gres=gpu:4\n"
                  for name in cluster.hosts)
        + "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
    )
    for i in range(4):
        (base / f"gpu{i}").touch()
    # no_gpu_env: no CUDA_VISIBLE_DEVICES from SLURM, so the tests' hiding of this machine's holds.
    (base / "gres.conf").write_text(f"Name=gpu File={base}/gpu[0-3] Flags=no_gpu_env\n")
    return conf


def _start_slurmd(host, conf, base):
    """slurmd for host, in its network namespace, with its name and /etc/hosts (`ip netns exec`
    would mount a sysfs without cgroups, where slurmd fails)."""
    (base / f"spool-{host.name}").mkdir()
    script = 'mount --bind "$1" /etc/hosts && hostname "$2" && exec slurmd -D -N "$2" -f "$3"'
    return _popen(["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "--mount",
                   "sh", "-c", script, "sh", f"/etc/netns/{host.netns}/hosts", host.name, conf],
                  base / f"slurmd-{host.name}.out")


def _wait_until_nodes_idle(slurm, base, timeout):
    deadline = time.monotonic() + timeout
    while True:
        result = subprocess.run(["sinfo", "--noheader", "--format=%n %t"], env=slurm.env(),
                                capture_output=True, text=True, timeout=30)
        if dict(line.split() for line in result.stdout.splitlines()) == dict.fromkeys(slurm.nodes, "idle"):
            return
        if time.monotonic() > deadline:
            logs = "".join(f"--- {log.name}\n{log.read_text()[-1500:]}" for log in sorted(base.glob("*.log")))
            raise RuntimeError(f"SLURM nodes not idle after {timeout} s: {result.stdout}{result.stderr}\n{logs}")
        time.sleep(0.2)
