"""Teardown latency of launch.sh on the simulated cluster (tests/cluster.py: network
namespaces, each with a real sshd, all on this machine), with train.py --arch cnn
--dataset synthetic running on every host (1 process each) and past its second step:

  SIGINT    seconds from SIGINT to launch.sh (Ctrl-C) until no process of the job is left:
            none on any host (sshd sessions included, the listening sshd aside) and launch.sh
            exited with its ssh clients here. Target <= 3 s.
  kill -9   seconds from SIGKILL of one worker (the train.py on the last host) until
            launch.sh has exited and every host is clean, as above. Target <= 10 s.

Both are polled every 50 ms, plus the time one look takes (all of /proc, per host), so the
figures are good to about 0.1 s. The table also shows when each part was done: no train.py
left on any host, no torchrun left, launch.sh's exit (and its status), the hosts clean, the
ssh clients here gone. The anchor to beat is a job
that hangs until the collective timeout: train.py's --timeout (300 s by default), NCCL's
10 minutes without one.

Full run: 4 hosts, 3 trials of each, judged on the worst trial. --quick: 2 hosts, 1 trial
of each. --launcher DIR (twice, to compare two copies of launch.sh and lib/, an older one
from git say) measures them in turn, trial by trial, in one run. Needs root, iproute2,
openssh-server and pytest (see tests/cluster.py).
"""
import argparse
import os
from pathlib import Path
import signal
import statistics
import tempfile
import time

import common
from common import (LONG_TRAIN, Launched, clock, is_torchrun, is_worker, limit_run_time,
                    print_machine, print_table, simulated_cluster, verdict)

TARGETS = {"SIGINT": 3.0, "kill -9": 10.0}
HOSTS, QUICK_HOSTS = 4, 2
TRIALS, QUICK_TRIALS = 3, 1
POLL = 0.05  # seconds between looks at the hosts
GIVE_UP = 30  # seconds after the event: past this, the trial failed and is killed
STEP_TIMEOUT = 120  # seconds for the job to reach its second step
RUNNING = r"^node\d+: epoch 1/\d+ step 2/"


def watch(cluster, hosts, launch, event):
    """Poll until launch.sh has exited, no host runs anything and no ssh client of launch.sh is
    left here; return the seconds after event at which each was first seen, None if not within
    GIVE_UP seconds."""
    done = dict.fromkeys(["workers gone", "torchruns gone", "launch.sh exited", "hosts clean",
                          "ssh clients gone"])
    while clock() - event < GIVE_UP:
        now = clock()
        running = [argv for h in hosts for _, argv in cluster.processes(h)]
        checks = {"workers gone": lambda: not any(is_worker(argv) for argv in running),
                  "torchruns gone": lambda: not any(is_torchrun(argv) for argv in running),
                  "launch.sh exited": lambda: launch.proc.poll() is not None,
                  "hosts clean": lambda: not running,
                  "ssh clients gone": lambda: launch.proc.poll() is not None
                  and not launch.processes()}
        for name, check in checks.items():
            if done[name] is None and check():
                done[name] = now - event
        if all(v is not None for v in done.values()):
            break
        time.sleep(POLL)
    return done


def trial(cluster, hosts, kind, launcher):
    with tempfile.TemporaryDirectory(prefix="bench-teardown-") as tmp:
        with Launched(cluster, hosts, 1, LONG_TRAIN, tmp, launch=launcher) as launch:
            launch.wait_for(RUNNING, STEP_TIMEOUT)
            if kind == "SIGINT":
                event = clock()
                launch.proc.send_signal(signal.SIGINT)
            else:
                (victim,) = [pid for pid, argv in cluster.processes(hosts[-1]) if is_worker(argv)]
                event = clock()
                os.kill(victim, signal.SIGKILL)
            done = watch(cluster, hosts, launch, event)
            status = launch.proc.poll()
        left = cluster.wait_until_idle(10)  # after Launched killed whatever a failed trial left
        if left:
            raise RuntimeError(f"left running on the hosts: {left}")
    all_done = None if None in done.values() else max(done.values())
    return {**done, "all clean": all_done, "status": status}


def seconds(value):
    return f"> {GIVE_UP}" if value is None else f"{value:.2f}"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK_HOSTS} hosts, {QUICK_TRIALS} trial of each")
    p.add_argument("--launcher", action="append", type=Path, metavar="DIR",
                   help="directory of the launch.sh to measure (default: this repository's); "
                        "twice, to compare two in turn")
    args = p.parse_args()
    n_hosts, trials = (QUICK_HOSTS, QUICK_TRIALS) if args.quick else (HOSTS, TRIALS)
    launchers = [d.resolve() / "launch.sh" for d in args.launcher or [common.REPO]]
    limit_run_time((150 if args.quick else 420) * len(launchers))

    print_machine()
    print("load average (1, 5, 15 min) before: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    began = time.monotonic()
    results = {(launcher, kind): [] for launcher in launchers for kind in TARGETS}
    with simulated_cluster(n_hosts) as cluster:
        hosts = cluster.hosts
        for t in range(trials):
            for launcher in launchers:
                for kind in TARGETS:
                    results[launcher, kind].append(trial(cluster, hosts, kind, launcher))
                    print(f"  trial {t + 1}, {launcher}, {kind}: all clean after "
                          f"{seconds(results[launcher, kind][-1]['all clean'])} s", flush=True)
    print(f"launch.sh {n_hosts} hosts x 1 process, train.py --arch cnn --dataset synthetic, "
          f"stopped after step 2; seconds after the event")
    parts = ["workers gone", "torchruns gone", "launch.sh exited", "hosts clean",
             "ssh clients gone", "all clean"]
    print_table(["launcher", "event", "trial", *parts, "exit status"],
                [(launcher.parent, kind, t + 1, *(seconds(r[c]) for c in parts), r["status"])
                 for launcher in launchers for kind in TARGETS
                 for t, r in enumerate(results[launcher, kind])])
    print(f"took {time.monotonic() - began:.0f} s")
    for launcher in launchers:
        summary = []
        for kind, target in TARGETS.items():
            times = [r["all clean"] for r in results[launcher, kind]]
            worst = None if None in times else max(times)
            median = statistics.median(t if t is not None else float("inf") for t in times)
            median = None if median == float("inf") else median
            ratio = float("inf") if worst is None else worst / target
            summary.append(f"{kind} worst {seconds(worst)} s (median {seconds(median)}) / target "
                           f"{target:.0f} s = {ratio:.2f}: {verdict(ratio, 1.0, at_least=False)}")
        print(f"{launcher.parent}: ratio worst / target: " + "; ".join(summary))


if __name__ == "__main__":
    main()
