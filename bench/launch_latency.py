"""Launch latency: seconds from starting ./launch.sh to the first training step on every host,
for 1, 2, 4 and 8 simulated hosts x 1 process (tests/cluster.py: network namespaces, each with
a real sshd, all on this machine), running train.py --arch cnn --dataset synthetic.

"First training step on every host" is observed as rank 0's `step 1/` line (train.py
--log-every 1) arriving at launch.sh's output here. Step 1 ends with the all-reduce of its
gradients, which cannot finish before every rank, on every host, has run step 1's forward
and backward. Rank 0's `start:` line, printed after init_process_group and the DDP wrap
(both need every rank), is shown as well. t(N) is the step-1 time; the target is
t(8) / t(1) <= 1.3, since launch.sh starts the hosts in parallel.

Where the time goes, from the processes' own start times (/proc/PID/stat, 10 ms ticks),
all in seconds after launch.sh was started:
  preflight    the first host's job ssh client started: launch.sh's start-up and its
               parallel preflight (one ssh per host: directory, torchrun, script, port)
  torchruns    the last host's torchrun started: the launcher's whole part
  workers      the last host's train.py started: torchrun's start-up (python, torch import)
               and its c10d rendezvous, which waits for every host
  start:       rank 0's start: line: the workers' torch import, init_process_group,
               synthetic data, model and DDP wrap
  step 1       rank 0's step 1 line (t(N))
  CPU s        CPU seconds used by every process on the hosts, read just after step 1 was
               seen (so slightly over): all hosts share this machine's cores, so t(N)
               cannot be much below CPU s / cores (the "floor" column), whatever the
               launcher does.

The launcher's part alone, without torch's start-up competing for the cores: a separate
run per host count with --torchrun set to a stub (a shell script that prints a line and
execs sleep), in a second table: the first host's job ssh client started (end of
preflight), the last one started (launch.sh starts hosts in a loop), and every host runs
the stub. Best of the rounds.

For comparison, "sequential ssh" (measured once, before the rounds) is the time a loop
`for host ...; do ssh host CHECK; done` takes on the same hosts, where CHECK is a
preflight-like command (cd to the repository, `command -v torchrun`, `test -f train.py`):
the moment a sequential launcher could start its last host, against launch.sh's preflight.
A loop of plain `ssh host torchrun ...` without `&` could not start a job at all: the
first host's rendezvous waits for the others. The same loop gives the CPU seconds one ssh
connection costs (the client's here, from getrusage; sshd's there, from the listening
sshd's reaped children): launch.sh makes two per host, preflight and job, and on this
machine both ends of every connection share the same cores.

Each host count runs once per round; the table shows, per host count, the round with the
smallest t(N) (best of 2 rounds; --quick: 1 round of 1 and 2 hosts). After each
measurement the job is stopped with SIGINT and the hosts are checked clean before the
next. --launcher DIR (twice, to compare two copies of launch.sh and lib/, an older one
from git say) measures them in turn, host count by host count, in one run. Needs root,
iproute2, openssh-server and pytest (see tests/cluster.py).
"""
import argparse
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (LONG_TRAIN, REPO, Launched, clock, is_torchrun, is_worker, limit_run_time,
                    print_machine, print_table, proc_stat, simulated_cluster, verdict)

TARGET = 1.3
HOSTS, QUICK_HOSTS = (1, 2, 4, 8), (1, 2)
ROUNDS, QUICK_ROUNDS = 2, 1
STEP_TIMEOUT = 120  # seconds for one launch to reach step 1
STEP_1 = r"^node\d+: epoch 1/\d+ step 1/"
START = r"^node\d+: start: world_size="


def argv_of(pid):
    """pid's command line as a list ([] once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def client_starts(launch):
    """Start times of launch.sh's job ssh clients: one per host, since the preflight's have
    exited before the job's start."""
    starts = []
    for pid in launch.processes():
        argv, stat = argv_of(pid), proc_stat(pid)
        if stat and argv and argv[0].endswith("ssh"):
            starts.append(stat[0])
    return starts


def snapshot(cluster, hosts, launch):
    """The job's processes, read once step 1 is seen (they all still run): per host, the
    start time of its torchrun and its worker; the start times of launch.sh's job ssh
    clients here; and the CPU seconds used by everything on the hosts."""
    torchruns, workers, cpu = {}, {}, 0.0
    for host in hosts:
        for pid, argv in cluster.processes(host):
            stat = proc_stat(pid)
            if stat is None:
                continue
            cpu += stat[1]
            kind = torchruns if is_torchrun(argv) else workers if is_worker(argv) else None
            if kind is not None:
                kind[host] = min(kind.get(host, stat[0]), stat[0])
    clients = client_starts(launch)
    missing = [h for h in hosts if h not in torchruns or h not in workers]
    if missing or len(clients) != len(hosts):
        raise RuntimeError(f"job processes not found on {missing or 'the ssh clients'}")
    return min(clients), max(torchruns.values()), max(workers.values()), cpu


def stop(cluster, launch):
    """SIGINT launch.sh (as Ctrl-C would), wait for it and for the hosts to be clean."""
    launch.proc.send_signal(signal.SIGINT)
    try:
        launch.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        print("  (launch.sh still running 20 s after SIGINT: killed)", flush=True)
    launch.stop()
    left = cluster.wait_until_idle(15)
    if left:
        raise RuntimeError(f"left running on the hosts after the job: {left}")


def measure(cluster, n_hosts, cores, launcher):
    hosts = cluster.hosts[:n_hosts]
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        with Launched(cluster, hosts, 1, LONG_TRAIN, tmp, launch=launcher) as launch:
            step_1 = launch.wait_for(STEP_1, STEP_TIMEOUT)
            first_client, torchruns, workers, cpu = snapshot(cluster, hosts, launch)
            start = launch.wait_for(START, 1)  # already there
            row = {"preflight": first_client, "torchruns": torchruns, "workers": workers,
                   "start:": start, "step 1": step_1}
            row = {k: v - launch.started for k, v in row.items()}
            row["CPU s"], row["floor"] = cpu, cpu / cores
            stop(cluster, launch)
    return row


STUB = "#!/bin/sh\necho stub-started\nexec sleep 599\n"  # for torchrun: costs no CPU


def measure_stub(cluster, n_hosts, launcher):
    """With a stub for torchrun: seconds from launch.sh's start until the first and the last
    of its job ssh clients started, and until every host ran the stub."""
    hosts = cluster.hosts[:n_hosts]
    with tempfile.TemporaryDirectory(prefix="bench-launch-") as tmp:
        stub = Path(tmp) / "torchrun"
        stub.write_text(STUB)
        stub.chmod(0o755)
        # As in a venv, a python beside it: it runs launch.sh's rendezvous probe on the hosts.
        (Path(tmp) / "python").symlink_to(sys.executable)
        with Launched(cluster, hosts, 1, LONG_TRAIN, tmp, ["--torchrun", stub], launcher) as launch:
            for host in hosts:  # its line says it runs: no polling to compete for the cores
                launch.wait_for(rf"^{host}: stub-started$", STEP_TIMEOUT)
            started = [stat[0] for host in hosts for pid, argv in cluster.processes(host)
                       if argv[:2] in (["sleep", "599"], ["/bin/sh", str(stub)])  # exec'd or not
                       and (stat := proc_stat(pid))]
            clients = client_starts(launch)
            if len(started) != n_hosts or len(clients) != n_hosts:
                raise RuntimeError(f"{len(started)} stubs and {len(clients)} ssh clients found "
                                   f"for {n_hosts} hosts:\n{launch.output()}")
            stop(cluster, launch)
    return [t - launch.started for t in (min(clients), max(clients), max(started))]


def reaped_cpu(pid):
    """CPU seconds of pid's children that it has waited for (cutime + cstime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def sequential_ssh(cluster, n_hosts):
    """Seconds for `for host in HOSTS; do ssh host CHECK; done`, one after another; and the
    CPU seconds per connection of the ssh client here and of the sshd processes there."""
    torchrun = shlex.quote(f"{sys.executable.rsplit('/', 1)[0]}/torchrun")
    check = f"cd {shlex.quote(str(REPO))} && command -v {torchrun} >/dev/null && test -f train.py"
    ssh = [*cluster.ssh_command.split(), "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
    hosts = cluster.hosts[:n_hosts]
    sshd_pids = [cluster.host(h).sshd_pid() for h in hosts]
    here, there = resource.getrusage(resource.RUSAGE_CHILDREN), sum(map(reaped_cpu, sshd_pids))
    began = clock()
    for host in hosts:
        subprocess.run([*ssh, host, check], check=True, timeout=30, capture_output=True)
    wall = clock() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    client = after.ru_utime + after.ru_stime - here.ru_utime - here.ru_stime
    return wall, client / n_hosts, (sum(map(reaped_cpu, sshd_pids)) - there) / n_hosts


def report(stubs, runs, seq, host_counts, rounds, cores):
    """The tables and ratios of one launcher's stubs and runs {host count: [rows]}."""
    stub = {n: min(stubs[n], key=lambda row: row[2]) for n in host_counts}
    best = {n: min(runs[n], key=lambda row: row["step 1"]) for n in host_counts}
    print(f"launch.sh HOSTS x 1 process, train.py --arch cnn --dataset synthetic, gloo, "
          f"OMP_NUM_THREADS=1; {cores} cores shared by all hosts; best of {rounds} round(s); "
          f"seconds after launch.sh started")
    columns = ["preflight", "torchruns", "workers", "start:", "step 1"]
    print_table(
        ["hosts", *columns, "step 1, each round", "CPU s", "floor"],
        [(n, *(f"{best[n][c]:.2f}" for c in columns),
          " ".join(f"{row['step 1']:.2f}" for row in runs[n]),
          f"{best[n]['CPU s']:.1f}", f"{best[n]['floor']:.2f}")
         for n in host_counts])
    print("the launcher alone, with the stub torchrun; and a sequential ssh loop, for comparison")
    print_table(["hosts", "preflight", "last ssh client", "stub on every host", "sequential ssh"],
                [(n, *(f"{x:.2f}" for x in stub[n]), f"{seq[n][0]:.2f}") for n in host_counts])
    lo, hi = min(host_counts), max(host_counts)
    print(f"launcher's part: t({hi}) / t({lo}) = {stub[hi][2] / stub[lo][2]:.2f} with the stub "
          f"({stub[lo][2]:.2f} s -> {stub[hi][2]:.2f} s); all torchruns started, in the runs "
          f"above: {best[hi]['torchruns'] / best[lo]['torchruns']:.2f}")
    client, server = seq[hi][1:]
    print(f"one ssh connection costs {client + server:.3f} CPU s here (client {client:.3f}, sshd "
          f"{server:.3f}); launch.sh makes 2 per host, so at {hi} hosts its ssh alone needs "
          f"{2 * hi * (client + server) / cores:.2f} s of {cores} cores")
    cpu = best[hi]["CPU s"] / best[lo]["CPU s"]
    floor = best[hi]["floor"]
    print(f"CPU seconds used by step 1: {cpu:.1f}x as many at {hi} hosts as at {lo}; on {cores} "
          f"cores they alone take {floor:.2f} s = {floor / best[lo]['step 1']:.2f} x t({lo})")
    ratio = best[hi]["step 1"] / best[lo]["step 1"]
    print(f"ratio t({hi}) / t({lo}) to step 1 on every host: {ratio:.2f} (target <= {TARGET}): "
          f"{verdict(ratio, TARGET, at_least=False)}")


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK_ROUNDS} round of 1 and 2 hosts (the ratio "
                        "line is t(2) / t(1): no t(8))")
    p.add_argument("--launcher", action="append", type=Path, metavar="DIR",
                   help="directory of the launch.sh to measure (default: this repository's); "
                        "twice, to compare two in turn")
    args = p.parse_args()
    host_counts, rounds = (QUICK_HOSTS, QUICK_ROUNDS) if args.quick else (HOSTS, ROUNDS)
    launchers = [d.resolve() / "launch.sh" for d in args.launcher or [REPO]]
    limit_run_time((150 if args.quick else 420) * len(launchers))

    cores = len(os.sched_getaffinity(0))
    print_machine()
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    began = time.monotonic()
    with simulated_cluster(max(host_counts)) as cluster:
        seq = {n: sequential_ssh(cluster, n) for n in host_counts}  # also warms sshd and ssh
        runs = {(launcher, n): [] for launcher in launchers for n in host_counts}
        stubs = {(launcher, n): [] for launcher in launchers for n in host_counts}
        for r in range(rounds):
            for n in host_counts:
                for launcher in launchers:
                    stubs[launcher, n].append(measure_stub(cluster, n, launcher))
                    runs[launcher, n].append(measure(cluster, n, cores, launcher))
                    print(f"  round {r + 1}, {n} host(s), {launcher}: stub on every host after "
                          f"{stubs[launcher, n][-1][2]:.2f} s, step 1 after "
                          f"{runs[launcher, n][-1]['step 1']:.2f} s", flush=True)
    for launcher in launchers:
        print(f"--- {launcher}")
        report({n: stubs[launcher, n] for n in host_counts}, {n: runs[launcher, n] for n in host_counts},
               seq, host_counts, rounds, cores)
    print(f"took {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()
