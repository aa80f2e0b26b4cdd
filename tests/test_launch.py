"""launch.sh: on this machine as any user, and as root on a simulated cluster of real sshd
hosts (cluster.py). One test per guarantee of docs/multi-node.md, merged where they start
the same processes."""

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

from cluster import cluster_fixture, keys_no_host_knows, launched_processes
from conftest import HIDDEN_GPUS, REPO, TINY, default_sigint, linux_only, run, skip_or_fail

pytestmark = linux_only("launch.sh's hosts read /proc")

LAUNCH = REPO / "launch.sh"
SHELL_SCRIPTS = ("launch.sh", "setup_ssh.sh", "lib/hosts.sh", "lib/node.sh", "train.sbatch", "bench/gpu.sh")
ODD_ARG = "two words 'quoted' \"double\" $(touch x) `touch y` ; * a\\b \\' !1 %s"
# node1's login shell is bash; fish and tcsh parse commands unlike sh; node4 refuses
# logins as a Slurm node does a user without a job there.
cluster = cluster_fixture(n_hosts=4, login_shells={"node2": "/usr/bin/fish", "node3": "/usr/bin/tcsh"},
                          slurm_refuses={"node4"}, banner="Authorized use only\n")


def launch_env(cluster=None, **extra):
    """This python's torchrun first on PATH, one thread, the GPUs hidden (launch.sh forwards
    all three); SSH_COMMAND for cluster, if given."""
    env = cluster.env() if cluster else {**os.environ, **HIDDEN_GPUS}
    return {**env, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
            **extra}


class Launch:
    """launch.sh in the background, in a session of its own, SIGINT at its default (see
    default_sigint); every process it starts here carries self.mark in its environment."""

    def __init__(self, args, env, cwd, out_dir, prefix=()):
        self.out_path, self.err_path = out_dir / "launch.out", out_dir / "launch.err"
        mark = os.urandom(8).hex()
        self.mark = f"TEST_LAUNCH={mark}".encode()
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([*prefix, LAUNCH, *map(str, args)], cwd=cwd, stdout=out, stderr=err,
                                         env={**env, "TMPDIR": str(out_dir), "TEST_LAUNCH": mark},
                                         start_new_session=True, preexec_fn=default_sigint)
        self.pid = self.proc.pid

    @property
    def out(self):
        return self.out_path.read_text()

    @property
    def err(self):
        return self.err_path.read_text()

    def wait(self, timeout):
        """Exit status; fail (after killing it) if it takes longer."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"launch.sh still running after {timeout}s\n{self.out}\n{self.err}")

    def wait_for(self, pattern, timeout=90, stream="out"):
        """Wait until pattern is in launch.sh's stdout (or "err")."""
        deadline = time.monotonic() + timeout
        while not re.search(pattern, getattr(self, stream), re.M):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"no {pattern!r} in its std{stream}\n{self.out}\n{self.err}")
            time.sleep(0.1)

    def job_id(self):
        return re.search(r"^launch.sh: job (\S+),", self.err, re.M).group(1)

    def processes(self):
        """Pids of launch.sh and of what it started here, in sessions of their own too."""
        return launched_processes(self.pid, self.mark)

    def job_processes(self):
        """Pids of its job's processes here (a local host's), which carry a LAUNCH_JOB mark."""
        pids = []
        for pid in self.processes():
            with contextlib.suppress(OSError):
                if b"\0LAUNCH_JOB=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes():
                    pids.append(pid)
        return pids

    def kill(self):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        for pid in self.processes():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture
def start(tmp_path, request):
    """start(args, env, cwd=REPO, prefix=()) -> Launch; all is killed afterwards."""
    launches = []

    def _start(args, env, cwd=REPO, prefix=()):
        out_dir = tmp_path / f"launch{len(launches)}"
        out_dir.mkdir()
        launches.append(Launch(args, env, cwd, out_dir, prefix))
        return launches[-1]

    yield _start
    for launch in launches:
        launch.kill()
    if "cluster" in request.fixturenames:
        for host in request.getfixturevalue("cluster").hosts:
            request.getfixturevalue("cluster").kill_all(host)


def run_launch(start, args, env, timeout=60, cwd=REPO, prefix=()):
    launch = start(args, env, cwd, prefix)
    launch.wait(timeout)
    return launch


def until(condition, timeout, interval=0.2):
    """condition()'s first true value within timeout seconds, else its last one."""
    deadline = time.monotonic() + timeout
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(interval)
    return value


def assert_nothing_left(cluster, launch, timeout=15):
    """No process on any host but its sshd, and none of the launch here."""
    left = cluster.wait_until_idle(timeout) if cluster else {}
    assert not left, f"left running on the hosts: {left}"
    assert until(lambda: not launch.processes() and not launch.job_processes(), timeout), \
        "left running here"


def stand_in_torchrun(tmp_path, body):
    """A torchrun for --torchrun that runs body (sh): what launch.sh does with a job, without
    torch's seconds of start-up. A python beside it, as in a venv, for the port check."""
    torchrun = tmp_path / "torchrun"
    torchrun.write_text(f"#!/bin/sh\n{body}\n")
    torchrun.chmod(0o755)
    (tmp_path / "python").symlink_to(sys.executable)
    return torchrun


def stand_in_that_stops_slowly(tmp_path):
    """A stand-in torchrun whose worker (sh, which cannot trap a SIGTERM ignored when it
    started) prints "started"; on SIGTERM "stopping", then a second later "stopped"."""
    return stand_in_torchrun(tmp_path, """sh -c 'trap "echo stopping; sleep 1; echo stopped; exit" TERM
echo started; while :; do sleep 1; done' & wait""")


def hostfile(tmp_path, *hosts):
    path = tmp_path / "hosts.txt"
    path.write_text("".join(f"{host}\n" for host in hosts))
    return path


def start_sleeping_job(start, tmp_path, hosts, env, options=()):
    """launch.sh on hosts with a stand-in torchrun that says "started" and sleeps; returns
    once every host has said so."""
    torchrun = stand_in_torchrun(tmp_path, "echo started\nexec /bin/sleep 600")  # whatever the job's PATH
    launch = start(["--log-dir", tmp_path / "logs", "--torchrun", torchrun, *options, hostfile(tmp_path, *hosts),
                    "1", "train.py"], env)
    for host in hosts:
        launch.wait_for(rf"^{re.escape(host)}: started$", 60)
    return launch


def fake_ssh(tmp_path):
    """An SSH_COMMAND that records that it was called, and fails."""
    script = tmp_path / "fake-ssh"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "ssh-called"}\nexit 255\n')
    script.chmod(0o755)
    return str(script), tmp_path / "ssh-called"


def ssh_here(tmp_path):
    """An SSH_COMMAND that runs the command here, through sh, as on made-up hosts with the
    SSH_CONNECTION each would have: box1 and box2 share one address, a tunnel ends at
    127.0.0.1, "bare" has none, "mute" fails without a word, "stuck" never answers,
    "lingers" keeps its session open; others are at 10.9.0.N (N = its name's length), and
    h1, h2, ... at 10.9.1.1, ...; all see this machine at 127.0.0.1, where a rendezvous
    here is reached without a packet leaving it."""
    script = tmp_path / "ssh-here"
    script.write_text(
        '#!/usr/bin/env bash\n'
        'host=${*: -2:1}\n'
        'case $host in\n'
        '  stuck) exec sleep 600 ;;\n'
        '  mute) exit 255 ;;\n'
        '  box1 | box2) export SSH_CONNECTION="10.9.0.1 40000 172.17.0.2 22" ;;\n'
        '  natted) export SSH_CONNECTION="198.51.100.7 40000 10.9.0.6 22" ;;\n'
        '  tunnel) export SSH_CONNECTION="127.0.0.1 40000 127.0.0.1 22" ;;\n'
        '  bare) unset SSH_CONNECTION ;;\n'
        '  h[0-9]*) export SSH_CONNECTION="127.0.0.1 40000 10.9.1.${host#h} 22" ;;\n'
        '  *) export SSH_CONNECTION="127.0.0.1 40000 10.9.0.${#host} 22" ;;\n'
        'esac\n'
        'if [[ $host == lingers ]]; then sh -c "${*: -1}"; exec sleep 600; fi\n'
        'exec sh -c "${*: -1}"\n')
    script.chmod(0o755)
    return str(script)


# ------------------------------------------------------------------ any user, no sshd


def test_help_and_usage_errors(tmp_path):
    for script in ("launch.sh", "setup_ssh.sh"):
        (tmp_path / script).symlink_to(REPO / script)  # as in ~/bin, away from lib/
        shown = run([tmp_path / script, "--help"], timeout=30, cwd=tmp_path)
        assert shown.returncode == 0 and shown.stdout.startswith(f"Usage: {script} "), shown.stderr
        assert len(shown.stdout.splitlines()) <= 25, shown.stdout
        with_sh = run(["sh", REPO / script, "--help"], timeout=30)
        assert (with_sh.returncode, with_sh.stdout, with_sh.stderr) == (2, "", f"{script}: run it with bash, not sh\n")
    help_text = run([LAUNCH, "--help"], timeout=30).stdout
    examples = help_text.split("\nExamples:\n")[1].splitlines()
    assert len([line for line in examples if "./launch.sh " in line]) == 3, help_text
    for option in ("--max-restarts N", "--torchrun PATH", "--workdir DIR", "--env-file FILE", "--port PORT",
                   "--log-dir DIR", "--dry-run", "LAUNCH_SILENCE_SECONDS", "SSH_COMMAND"):
        assert option in help_text
    usage = "launch.sh [options] HOSTFILE NPROC_PER_NODE [SCRIPT [ARGS...]]"
    for args, message in [
        ([], f"missing HOSTFILE and NPROC_PER_NODE: {usage}"),
        (["hosts.txt"], f"missing NPROC_PER_NODE: {usage}"),
        (["--dry-run=yes", "hosts.txt", "2"], "--dry-run takes no value"),
        (["--port=", "hosts.txt", "2"], "--port needs a value"),
        (["--port", "70000", "hosts.txt", "2"], "--port must be a port number: 70000"),
        (["--nodes", "2", "hosts.txt", "2"], "unknown option: --nodes (see --help)"),
        (["hosts.txt", "2", "--arch", "cnn"], "SCRIPT comes before its arguments: launch.sh hosts.txt 2 train.py --arch ..."),
        (["hosts.txt", "2", "--dry-run"], "--dry-run is an option of launch.sh: put it before HOSTFILE"),
        (["hosts.txt", "2", "-m", "pkg.train"], "SCRIPT is a file, not -m MODULE: give a script that runs the module"),
        (["hosts.txt", "all"], "NPROC_PER_NODE must be a positive integer, or torchrun's auto, gpu or cpu: all"),
    ]:
        result = run([LAUNCH, *args], timeout=30, cwd=REPO, env=launch_env())
        assert (result.returncode, result.stdout, result.stderr) == (2, "", f"launch.sh: {message}\n"), args
    setup = run([REPO / "setup_ssh.sh"], timeout=30)
    assert (setup.returncode, setup.stderr) == (2, "setup_ssh.sh: missing HOSTFILE: setup_ssh.sh [--key PATH] HOSTFILE\n")


def test_bad_input_exits_2_and_starts_nothing(tmp_path):
    marker = tmp_path / "injected"
    env_file = tmp_path / "env"
    ssh_command, ssh_called = fake_ssh(tmp_path)
    for hosts, nproc, env_text, message in [
        (None, "2", None, "hosts.txt: no such file"),
        ("", "2", None, "hosts.txt: no hosts"),
        ("# only a comment\n\n", "2", None, "hosts.txt: no hosts"),
        ("localhost;touch {marker}\n", "2", None, "hosts.txt:1: not a [user@]host[:port]: localhost\\;touch\\ "),
        ("localhost\n$(touch {marker})\n", "2", None, "hosts.txt:2: not a [user@]host[:port]: \\$\\(touch\\ "),
        ("`touch {marker}`\n", "2", None, "not a [user@]host[:port]: \\`touch"),
        ("-oProxyCommand=touch {marker}\n", "2", None, "not a [user@]host[:port]: -oProxyCommand=touch"),
        ("node1 slots=4\n", "2", None, "not a [user@]host[:port]: node1\\ slots=4\n"),  # DeepSpeed's
        ("local\u00a0host\n", "2", None, "not a [user@]host[:port]: $'local\\302\\240host'"),  # pasted
        ("node1:0\n", "2", None, "hosts.txt:1: bad port: node1:0"),
        ("node1\nnode2\nNODE1:22\n", "2", None, "hosts.txt:3: duplicate host: NODE1:22 (also on line 1)"),
        ("localhost\n127.0.0.1\n", "2", None, "duplicate host: 127.0.0.1 (this machine, also on line 1)"),
        ("localhost\n", "0", None, "NPROC_PER_NODE must be a positive integer"),
        ("localhost\n", "1", "GOOD=1\nexport BAD=s3cret\n", "env:2: not KEY=VALUE (no export, no spaces around "
                                                            "=): export BAD\n"),
    ]:
        path = tmp_path / "hosts.txt"
        path.unlink(missing_ok=True)
        if hosts is not None:
            path.write_text(hosts.format(marker=marker))
        options = []
        if env_text is not None:
            env_file.write_text(env_text)
            options = ["--env-file", env_file]
        result = run([LAUNCH, *options, path, nproc], timeout=30, cwd=tmp_path,
                     env=launch_env(SSH_COMMAND=ssh_command))
        assert result.returncode == 2 and result.stdout == "", (hosts, result.stderr)
        assert message in result.stderr and result.stderr.startswith("launch.sh: "), (hosts, result.stderr)
        assert len(result.stderr.splitlines()) == 1, result.stderr
    assert not marker.exists() and not ssh_called.exists() and not (tmp_path / "logs").exists()
    silence = run([LAUNCH, "hosts.txt", "1"], timeout=30, cwd=REPO, env=launch_env(LAUNCH_SILENCE_SECONDS="x"))
    assert (silence.returncode, silence.stderr) == (
        2, "launch.sh: LAUNCH_SILENCE_SECONDS must be a whole number of seconds: x\n")


def test_hosts_sh_prints_the_hosts_for_check_env(tmp_path):
    """check_env.py reads hosts files through it: one parser for both."""
    path = tmp_path / "hosts.txt"
    path.write_text("\ufeff# first line after a byte-order mark\r\n  root@node1:2222  # a comment\r\n"
                    f"node2\nlocalhost\n{socket.gethostname()}:22\n")
    result = run(["bash", REPO / "lib/hosts.sh", path], timeout=30)
    assert result.returncode == 0, result.stderr
    ssh = "\t".join(["ssh", "-T", "-o", "ConnectTimeout=5", "-o", "ServerAliveInterval=5", "-o",
                     "ServerAliveCountMax=3", "-o", "RemoteCommand=none", "-o", "ClearAllForwardings=yes",
                     "-o", "BatchMode=yes", "-o", "LogLevel=INFO"])
    assert result.stdout == (f"root@node1:2222\t\t{ssh}\t-p\t2222\troot@node1\nnode2\t\t{ssh}\tnode2\n"
                             f"localhost\tyes\n{socket.gethostname()}:22\t\t{ssh}\t-p\t22\t{socket.gethostname()}\n")
    why = subprocess.run(["bash", REPO / "lib/hosts.sh", "--ssh-failure", path], capture_output=True, text=True,
                         input="Permission denied (publickey).\r\n", timeout=30)
    assert why.stdout == (f"Permission denied (publickey). ({REPO}/setup_ssh.sh {path} installs your key (one with "
                          "a passphrase needs ssh-add first))\n"), why.stderr
    path.write_text("node1\nnode1\n")
    result = run(["bash", REPO / "lib/hosts.sh", path], timeout=30)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"hosts.sh: {path}:2: duplicate host: node1 (also on line 1)\n"


def test_this_machine_runs_without_ssh(tmp_path):
    """localhost, this machine's name and 127.x run here (and a BOM, CRLF or comment is no
    part of a name); --workdir relative to here, or ~/ after an option's =."""
    ssh_command, ssh_called = fake_ssh(tmp_path)
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "probe.py").touch()
    env_file = tmp_path / "env"  # as a Windows editor saves it: a byte-order mark, CRLF
    env_file.write_text("\ufeff# a comment\r\nPLAIN=a b\r\nQUOTED=\"a b\"\r\nEXPANDED=/opt/bin:$PATH\r\n")
    for name in ("localhost", socket.gethostname(), "127.0.0.1", "\ufefflocalhost\r"):
        hosts = hostfile(tmp_path, name)
        result = run([LAUNCH, "--dry-run", "--workdir=~/x", "--env-file", env_file, hosts, "1", "probe.py"],
                     timeout=30, env=launch_env(SSH_COMMAND=ssh_command, HOME=str(tmp_path)))
        assert result.returncode == 0, result.stderr
        line = result.stdout.splitlines()[1]
        assert line.startswith(f"{name.strip(chr(0xFEFF) + chr(13))} (local): cd '{tmp_path / 'x'}' && "), line
        assert "'--rdzv-endpoint=127.0.0.1:" in line and "'--local-addr=127.0.0.1'" in line, line
    assert result.stdout.splitlines()[0].endswith(" PLAIN QUOTED EXPANDED"), result.stdout  # forwarded, after the rest
    assert result.stderr == "".join(
        f"launch.sh: warning: {env_file}:{n}: {key} gets its value as written, quotes and $ included\n"
        for n, key in ((3, "QUOTED"), (4, "EXPANDED")))
    result = run([LAUNCH, "--dry-run", "--workdir", "tests", hosts, "1", "noisy_probe.py"], timeout=30, cwd=REPO,
                 env=launch_env(SSH_COMMAND=ssh_command))
    assert f"(local): cd '{REPO / 'tests'}' && " in result.stdout, result.stderr
    assert not ssh_called.exists()


@pytest.mark.parametrize("script", ["launch.sh", "setup_ssh.sh"])
def test_a_blank_SSH_COMMAND_is_ssh(tmp_path, script):
    hosts = hostfile(tmp_path, "host")
    ssh_command, ssh_called = fake_ssh(tmp_path)
    Path(ssh_command).rename(tmp_path / "ssh")
    args = {"launch.sh": ["--dry-run", hosts, "1"], "setup_ssh.sh": ["--key", tmp_path / "id", hosts]}[script]
    env = launch_env(SSH_COMMAND=" ", PATH=f"{tmp_path}:{launch_env()['PATH']}")
    result = run([REPO / script, *args], timeout=30, cwd=REPO, env=env, stdin=subprocess.DEVNULL)
    assert result.returncode == 1, result.stdout + result.stderr
    assert " host " in ssh_called.read_text()


def test_two_processes_train_on_localhost(tmp_path, start, mnist_dir):
    """The README's first multi-process run: gloo, two ranks, through launch.sh."""
    launch = run_launch(start, ["--log-dir", tmp_path / "logs", hostfile(tmp_path, "localhost"), "2", "train.py", *TINY,
                                "--data", mnist_dir, "--epochs", "1", "--max-steps", "3"],
                        launch_env(), timeout=120, cwd=REPO)
    assert launch.proc.returncode == 0, launch.out + launch.err
    assert re.search(r"^localhost: start: world_size=2 backend=gloo", launch.out, re.M), launch.out
    assert re.search(r"^localhost: epoch 1/1 .*test_acc", launch.out, re.M), launch.out
    log = (tmp_path / "logs" / launch.job_id() / "localhost.log").read_text()
    assert [f"localhost: {line}" for line in log.splitlines()] == launch.out.splitlines()
    assert re.search(r"^  localhost +0 +\d+$", launch.err, re.M), launch.err
    assert_nothing_left(None, launch)


def test_preflight_gives_up_on_hosts_that_never_answer(tmp_path, start):
    """All hosts are checked at once, each for LAUNCH_SILENCE_SECONDS at most; a signal stops
    the checks."""
    env = launch_env(SSH_COMMAND=ssh_here(tmp_path), LAUNCH_SILENCE_SECONDS="3")
    began = time.monotonic()
    launch = run_launch(start, ["--dry-run", hostfile(tmp_path, "stuck", "fine", "lingers", "mute"), "1",
                                "train.py"], env, timeout=30)
    assert launch.proc.returncode == 1, launch.out + launch.err
    assert time.monotonic() - began < 3 + 3, "checked one after another?"
    assert launch.err.splitlines() == [
        "launch.sh: preflight failed, nothing was started:",
        "  stuck    no answer within 3 s",
        "  lingers  its check passed, but its SSH session stayed open: a program that a login script starts in "
        "the background holds its output (add >/dev/null 2>&1 there)",
        "  mute     ssh said nothing"], launch.err
    assert until(lambda: not launch.processes(), 5)
    launch = start(["--dry-run", hostfile(tmp_path, "fine", "stuck"), "1", "train.py"], env)
    time.sleep(1)
    os.killpg(launch.pid, signal.SIGTERM)  # as timeout(1) sends it
    assert launch.wait(10) == 143, launch.err
    assert launch.err == "launch.sh: stopped during preflight, nothing was started\n"
    assert until(lambda: not launch.processes(), 5)


def test_preflight_rejects_addresses_the_other_hosts_cannot_use(tmp_path, start):
    env = launch_env(SSH_COMMAND=ssh_here(tmp_path))
    launch = run_launch(start, ["--dry-run", hostfile(tmp_path, "fine", "box1", "box2", "tunnel", "bare"), "1",
                                "train.py"], env)
    assert launch.proc.returncode == 1, launch.out + launch.err
    assert launch.err.splitlines()[1:] == [
        "  box2    reached at 172.17.0.2, as box1 is (one machine under two names? containers behind one "
        "address?): every host needs its own address",
        "  tunnel  reached at 127.0.0.1 (a tunnel?): list it by an address the other hosts can reach",
        "  bare    its sshd sets no SSH_CONNECTION, so its address is unknown"], launch.err
    behind_nat = run_launch(start, ["--dry-run", hostfile(tmp_path, "localhost", "natted"), "1", "train.py"], env)
    assert behind_nat.proc.returncode == 1 and behind_nat.err.splitlines()[1:] == [
        "  localhost  the other hosts see this machine as 198.51.100.7, which it does not hold (NAT or a jump "
        "host?): launch from a host they reach directly"], behind_nat.err
    alone = run_launch(start, ["--dry-run", hostfile(tmp_path, "tunnel"), "auto", "train.py"], env)
    assert alone.proc.returncode == 0, alone.err  # no other host needs to reach it
    assert "'--local-addr=127.0.0.1'" in alone.out and "'--nproc-per-node=auto'" in alone.out, alone.out


def test_signal_to_the_whole_group_while_hosts_start(tmp_path, start):
    """A SIGTERM to the whole group as the hosts start is neither lost nor fatal mid-start:
    launch.sh stops them all and waits for them."""
    logs = tmp_path / "logs"
    launch = start(["--log-dir", logs, "--torchrun", stand_in_torchrun(tmp_path, "exit 0"),
                    hostfile(tmp_path, "localhost", *(f"h{i}" for i in range(2, 21))), "1", "train.py"],
                   launch_env(SSH_COMMAND=ssh_here(tmp_path)))
    assert until(lambda: list(logs.glob("*/localhost.log")) or launch.proc.poll() is not None, 60, 0.005)
    os.kill(launch.pid, signal.SIGSTOP)  # in mid-loop
    os.killpg(launch.pid, signal.SIGTERM)  # a pipeline yet to ignore it dies now
    os.kill(launch.pid, signal.SIGCONT)
    assert launch.wait(30) == 143, launch.err
    assert re.search(r"HOST +EXIT", launch.err), launch.err  # the summary: it waited for the hosts
    assert until(lambda: not launch.processes(), 5)


def test_a_host_that_ends_at_once_is_never_a_failure(tmp_path, start):
    """Races between launch.sh and a host's pipeline show as failures of jobs that end at once."""
    hosts = hostfile(tmp_path, "localhost")
    for attempt in range(5):
        launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", "/bin/true", hosts, "1",
                                    "train.py"], launch_env())
        assert launch.proc.returncode == 0, f"attempt {attempt}: {launch.err}"
        assert not launch.processes(), f"attempt {attempt}"  # not even a zombie


def test_its_own_output_lost_fails_no_host(tmp_path):
    """As with `> out.log 2>&1` on a full disk, or `| head`: the job runs on, the log has all."""
    torchrun = stand_in_torchrun(tmp_path, "seq -f %0100g 1000")  # more than a pipe holds
    for n, redirect in enumerate((">/dev/full", ">/dev/full 2>&1", "| head -c 0")):
        result = run(["bash", "-c", f'"$0" "$@" {redirect}; exit "${{PIPESTATUS[0]}}"', LAUNCH,
                      "--log-dir", tmp_path / f"logs{n}", "--torchrun", torchrun, hostfile(tmp_path, "localhost"),
                      "1", "train.py"],
                     env=launch_env(), cwd=REPO, timeout=60)
        assert result.returncode == 0, (redirect, result.stderr)
        [log] = (tmp_path / f"logs{n}").glob("*/localhost.log")
        assert log.read_text().splitlines() == [f"{i:0100d}" for i in range(1, 1001)], redirect


def test_a_failed_host_shows_the_end_of_its_log(tmp_path, start):
    """Not torchrun's own report (a traceback and a table), which would push out the workers'
    error; launch.sh's own lines from the host, however far up; a killed torchrun in one line."""
    torchrun = stand_in_torchrun(tmp_path, "echo 'launch.sh: a word from the host'\nseq 30\n"
                                 "echo 'train.py: error: the cause'\necho 'Traceback (most recent call last):'\n"
                                 "seq 30\necho 'torch.distributed.elastic.multiprocessing.errors.ChildFailedError:'\n"
                                 "seq 25\nexit 1")
    launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile(tmp_path, "localhost"), "1",
                                "train.py"], launch_env())
    assert launch.proc.returncode == 1
    assert launch.err.endswith("launch.sh: localhost failed first (exit 1); the end of its log:\n"
                               "  localhost: launch.sh: a word from the host\n"
                               + "".join(f"  localhost: {n}\n" for n in range(12, 31))
                               + "  localhost: train.py: error: the cause\n"), launch.err
    torchrun.write_text("#!/bin/sh\necho started\nexec sleep 600\n")
    launch = start(["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile(tmp_path, "localhost"), "1", "train.py"],
                   launch_env())
    launch.wait_for("^localhost: started$")
    (victim,) = until(lambda: [pid for pid in launch.job_processes()
                               if Path(f"/proc/{pid}/comm").read_text() == "sleep\n"], 10)
    os.kill(victim, signal.SIGKILL)  # as the OOM killer would
    assert launch.wait(15) == 1
    assert launch.err.endswith("  localhost: started\n"
                               "  localhost: launch.sh: torchrun was killed by SIGKILL (status 137)\n"), launch.err


def test_a_process_left_holding_the_output_keeps_no_host_waiting(tmp_path, start):
    """One that dropped the mark (or that no signal ends, stuck in the kernel) still holds
    the job's output: the host's part ends regardless, and launch.sh with it."""
    orphan = tmp_path / "orphan.pid"
    torchrun = stand_in_torchrun(tmp_path, f"env -u LAUNCH_JOB sleep 60 &\necho $! > {orphan}\nexit 1")
    try:
        began = time.monotonic()
        launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile(tmp_path, "localhost"), "1",
                                    "train.py"], launch_env())
        assert launch.proc.returncode == 1, launch.err
        assert time.monotonic() - began < 20  # not the orphan's 60 s
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(orphan.read_text()), signal.SIGKILL)


def test_scripts_pass_shellcheck_and_kill_by_the_job_only():
    if not shutil.which("shellcheck"):
        skip_or_fail("shellcheck not installed")
    result = subprocess.run(["shellcheck", "-x", *SHELL_SCRIPTS], capture_output=True, text=True, timeout=60,
                            cwd=REPO)
    assert result.returncode == 0, result.stdout
    for script in SHELL_SCRIPTS[:4]:
        assert not re.search(r"pkill\s+(-\w+\s+)*-\w*f|killall", (REPO / script).read_text()), script


# What bash added after 4.4 (launch.sh's floor, RHEL 8's) that a script is likely to use:
# only bash 5.2 is here to run the tests, so a construct from these would pass them.
NEWER_THAN_BASH_4_4 = {
    r"\bwait(\s+-\w+)*\s+-\w*[pf]": "wait -p (5.1), wait -f (5.0)",
    r"\bwait\s+-n\s+[\"$%0-9]": "wait -n ID (5.1: 4.4 waits for any job)",
    r"\b(localvar_inherit|localvar_unset|assoc_expand_once|noexpand_translation|"
    r"patsub_replacement|varredir_close|globskipdots)\b": "a shopt option of bash 5",
    r"\bEPOCH(SECONDS|REALTIME)\b|\bSRANDOM\b|\bBASH_ARGV0\b": "a variable of bash 5",
    r"@[ULuKk]\}": "${var@U} and kin (5.1, 5.2)",
}


def test_scripts_use_nothing_newer_than_bash_4_4():
    for script in SHELL_SCRIPTS[:4]:
        code = [line for line in (REPO / script).read_text().splitlines() if not line.lstrip().startswith("#")]
        found = [(line.strip(), what) for line in code
                 for pattern, what in NEWER_THAN_BASH_4_4.items() if re.search(pattern, line)]
        assert found == [], script


# ------------------------------------------------------------------ root: the simulated cluster


def test_train_on_three_hosts_one_of_them_here(cluster, tmp_path, start, mnist_dir):
    """Output prefixed line by line, into one log per host; the first host local, the others'
    login shells fish and tcsh, ssh's config as for interactive use (a forced terminal, a
    command of its own, a port forwarded that is in use) and showing the sites' banners."""
    hosts = hostfile(tmp_path, "localhost", "node2", "node3")
    env_file = tmp_path / "env"
    env_file.write_text("LOGLEVEL=INFO\n")  # torchrun logs at INFO, so that every host prints
    with cluster.ssh_with_an_interactive_config(tmp_path / "ssh_config", "RequestTTY force\nLogLevel INFO\n") as ssh:
        launch = run_launch(start, ["--workdir", REPO, "--env-file", env_file, hosts, "1", "train.py", *TINY,
                                    "--data", mnist_dir, "--epochs", "1", "--max-steps", "4"],
                            launch_env(cluster, SSH_COMMAND=ssh), timeout=180, cwd=tmp_path)
    assert launch.proc.returncode == 0, launch.out + launch.err
    assert re.search(r"^(localhost|node2|node3): start: world_size=3 backend=gloo", launch.out, re.M), launch.out
    assert re.search(r"^(localhost|node2|node3): epoch 1/1 .*test_acc", launch.out, re.M), launch.out
    assert "\r" not in launch.out and all(re.match("(localhost|node2|node3): ", line) for line in launch.out.splitlines())
    assert "Authorized use only" not in launch.out + launch.err
    for host in ("localhost", "node2", "node3"):
        log = (tmp_path / "logs" / launch.job_id() / f"{host}.log").read_text()
        assert log and [line for line in launch.out.splitlines() if line.startswith(f"{host}: ")] == [
            f"{host}: {line}" for line in log.splitlines()]
        assert re.search(rf"^  {host} +0 +\d+$", launch.err, re.M), launch.err
    assert_nothing_left(cluster, launch)


def test_output_lines_arrive_whole(cluster, tmp_path, start):
    """A host's processes write stdout and stderr, whole lines at a time: the two meet in one
    pipe there; merged only here, from ssh's two channels, they would cut each other's lines."""
    probe = f"{sys.executable} {REPO / 'tests' / 'noisy_probe.py'}"
    torchrun = stand_in_torchrun(tmp_path, f"RANK=0 {probe} & RANK=1 {probe}; wait")
    launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun,
                                hostfile(tmp_path, "node1", "node2"), "1", "train.py"], launch_env(cluster))
    assert launch.proc.returncode == 0, launch.err
    noisy = [line for line in launch.out.splitlines() if "noisy:" in line]
    whole = re.compile(r"^node[12]: noisy: rank=[01] line=\d+ x{200} end$")
    assert len(noisy) == 2 * 2 * 2 * 300
    assert [line for line in noisy if not whole.match(line)] == []


def test_dry_run_checks_every_host_and_starts_nothing(cluster, tmp_path, start):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("# the rendezvous host first\n\n  root@node1:22  # with user and port\nnode2\n")
    launches = [run_launch(start, ["--dry-run", *port, "--log-dir", tmp_path / "logs", hosts, "2", "train.py",
                                   "--epochs", "1"], launch_env(cluster)) for port in (["--port=29999"], [])]
    node1, node2 = cluster.address("node1"), cluster.address("node2")
    ids = set()
    for launch in launches:
        assert launch.proc.returncode == 0, launch.err
        env_line, line1, line2 = launch.out.splitlines()
        assert env_line.startswith("environment on every host (a local one also has the rest of this shell's): ")
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in env_line and "OMP_NUM_THREADS" in env_line
        assert line1.startswith(f"root@node1:22 (ssh -p 22 root@node1): cd '{REPO}' && ")
        assert line2.startswith(f"node2 (ssh node2): cd '{REPO}' && ")
        for line, address in ((line1, node1), (line2, node2)):
            assert "'--nnodes=2' '--nproc-per-node=2' '--rdzv-backend=c10d'" in line
            assert f"'--local-addr={address}' 'train.py' '--epochs' '1'" in line
            ids.add(re.search(rf"'--rdzv-endpoint={node1}:(\d+)' '--rdzv-id=(\S+)'", line).groups())
    (port, first_id), (free_port, second_id) = sorted(ids, key=lambda found: found[0] != "29999")
    assert port == "29999" and free_port != "29999" and first_id != second_id, ids  # an id per launch
    assert not (tmp_path / "logs").exists() and not cluster.wait_until_idle(0)


def test_preflight_says_what_failed_on_each_host_and_starts_nothing(cluster, tmp_path, start):
    node1, node2 = cluster.address("node1"), cluster.address("node2")
    keys = keys_no_host_knows(tmp_path)  # offered before the one the hosts take: more than sshd allows
    known_lines = cluster.known_hosts.read_text().splitlines()
    node2_key = known_lines[1].split(" ", 1)[1]
    known = tmp_path / "known_hosts"  # node3's key as if it changed
    known.write_text("".join(f"{line.split(' ', 1)[0]} {node2_key}\n" if line.startswith("node3,") else f"{line}\n"
                             for line in known_lines))
    config = tmp_path / "ssh_config"
    config.write_text(f"Host many-keys\n  HostName {node2}\n" + "".join(f"  IdentityFile {k}\n" for k in keys)
                      + f"Host new\n  HostName {node1}\n  UserKnownHostsFile /dev/null\n"
                      f"Host *\n  UserKnownHostsFile {known}\nInclude {cluster.ssh_config}\n")
    hosts = hostfile(tmp_path, "node1", "nobody@node2", "node3", "node4", cluster.unreachable_address,
                     "many-keys", "new", node1)
    began = time.monotonic()
    launch = run_launch(start, ["--log-dir", tmp_path / "logs", hosts, "1", "train.py"],
                        launch_env(cluster, SSH_COMMAND=f"ssh -F {config}"), timeout=40)
    assert launch.proc.returncode == 1, launch.out + launch.err
    assert time.monotonic() - began < 20  # ssh's ConnectTimeout of 5 s, once: all at once
    rows = dict(re.findall(r"^  (\S+) +(.*)$", launch.err, re.M))
    assert launch.err.startswith("launch.sh: preflight failed, nothing was started:\n"), launch.err
    setup_ssh = f"{REPO / 'setup_ssh.sh'} {hosts}"
    assert list(rows) == hosts.read_text().split()[1:], launch.err
    assert "Permission denied (publickey" in rows["nobody@node2"]
    assert rows["nobody@node2"].endswith(f" ({setup_ssh} installs your key (one with a passphrase needs ssh-add "
                                         "first))")
    assert rows["node3"].startswith("Host key verification failed. (its key changed since it was recorded: find "
                                    "out why, then ssh-keygen -f ") and cluster.address("node3") in rows["node3"]
    assert rows["node4"] == ("Access denied by pam_slurm_adopt: you have no active jobs on this node (Slurm lets "
                             "in only users with a job there: work in an allocation of them, or use train.sbatch)")
    assert re.fullmatch(r"ssh: connect to host \S+ port 22: (No route to host|Connection timed out)",
                        rows[cluster.unreachable_address]), rows
    assert rows["many-keys"] == (f"Received disconnect from {node2} port 22:2: Too many authentication failures "
                                 "(ssh offers other keys first, more than the host takes: give these hosts "
                                 "'IdentityFile KEY' and 'IdentitiesOnly yes' in ~/.ssh/config)")
    assert rows["new"] == f"Host key verification failed. ({setup_ssh} records a new host's key)"
    assert rows[node1] == (f"reached at {node1}, as node1 is (one machine under two names? containers behind one "
                           "address?): every host needs its own address")
    for args, host, problem in [
        (["--torchrun", "/no/such/torchrun"], "node2", "no torchrun at /no/such/torchrun here: see --torchrun"),
        (["--workdir", "/no/such/dir"], "node2", "cannot enter /no/such/dir here (No such file or directory): "
                                                 "see --workdir"),
        (["--workdir", tmp_path], "node2", f"no train.py in {tmp_path}: cd to it, or see --workdir"),
    ]:
        launch = run_launch(start, ["--dry-run", *args, hostfile(tmp_path, "node1", host), "1"], launch_env(cluster))
        assert launch.proc.returncode == 1, launch.err
        assert launch.err.splitlines()[1:] == [f"  node1  {problem}", f"  {host}  {problem}"], launch.err
    listener = subprocess.Popen(cluster.command("node1", [  # another job's, on torch's default port
        sys.executable, "-c", "import socket, time; s = socket.socket(); s.bind(('', 29500)); s.listen(); "
        "print('listening', flush=True); time.sleep(60)"]), stdout=subprocess.PIPE, text=True,
        start_new_session=True)
    try:
        assert listener.stdout.readline() == "listening\n"
        hosts = hostfile(tmp_path, "node1", "node2")
        taken = run_launch(start, ["--dry-run", "--port", "29500", hosts, "1"], launch_env(cluster))
        free = run_launch(start, ["--dry-run", hosts, "1"], launch_env(cluster))
    finally:
        os.killpg(listener.pid, signal.SIGKILL)
        listener.wait()
    assert taken.proc.returncode == 1, taken.err
    assert taken.err.splitlines()[1:] == ["  node1  port 29500 (--port) cannot be bound here: Address already in use"]
    assert free.proc.returncode == 0, free.err
    assert re.search(rf"'--rdzv-endpoint={node1}:(?!29500')\d+'", free.out), free.out  # a free one
    assert not (tmp_path / "logs").exists() and not cluster.wait_until_idle(0)


@contextlib.contextmanager
def firewall_drops_the_rendezvous_port(cluster, port):
    """An nft rule on node1 that drops what reaches port from the other hosts, as cloud
    firewalls do."""
    if not shutil.which("nft"):
        skip_or_fail("nft not installed (apt-get install nftables)")
    table = ["inet", "launch_test"]
    for rule in (["add", "table", *table],
                 ["add", "chain", *table, "input", "{ type filter hook input priority 0; }"],
                 ["add", "rule", *table, "input", "iifname", "eth0", "tcp", "dport", str(port), "drop"]):
        cluster.run("node1", ["nft", *rule], check=True, timeout=10)
    try:
        yield
    finally:
        cluster.run("node1", ["nft", "delete", "table", *table], check=True, timeout=10)


def test_a_host_cut_off_from_the_rendezvous_fails_in_one_line(cluster, tmp_path, start):
    """torchrun would wait 60 s for its store, then fail in a traceback."""
    with firewall_drops_the_rendezvous_port(cluster, 29555):
        began = time.monotonic()
        launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--port", "29555", "--torchrun",
                                    stand_in_torchrun(tmp_path, "echo started\nexec sleep 600"),
                                    hostfile(tmp_path, "node1", "node2"), "1", "train.py"], launch_env(cluster))
        assert launch.proc.returncode == 1, launch.out + launch.err
        assert time.monotonic() - began < 30
    assert launch.err.endswith(
        "launch.sh: node2 failed first (exit 1); the end of its log:\n  node2: launch.sh: this host cannot reach the "
        f"rendezvous at {cluster.address('node1')} port 29555 on the first host (no answer in 10 s): a firewall? The "
        "hosts must reach each other on every TCP port\n"), launch.err
    assert re.search(r"^  node1 +143 +\d+  \(stopped by launch.sh\)$", launch.err, re.M), launch.err
    assert_nothing_left(cluster, launch)


def test_a_failing_host_stops_the_others_and_is_named(cluster, tmp_path, start):
    """A host's failure (here node2's, after it printed its cause) stops the others at once.
    When the first host's job fails, the others' torchruns fail for want of its rendezvous
    store, and may end first: the summary points to the first host's log."""
    torchrun = stand_in_torchrun(tmp_path, 'case $(hostname) in\n  node2) sleep 1; echo "the cause"; exit 1 ;;\n'
                                           '  *) echo started; exec sleep 600 ;;\nesac')
    began = time.monotonic()
    launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun,
                                hostfile(tmp_path, "node1", "node2", "node3"), "1", "train.py"], launch_env(cluster))
    assert launch.proc.returncode == 1 and time.monotonic() - began < 20, launch.err
    assert re.search(r"^  node1 +143 +\d+  \(stopped by launch.sh\)\n  node2 +1 +\d+\n  node3 +143 +\d+  \(stopped by launch.sh\)\n"
                     r"launch.sh: node2 failed first \(exit 1\); the end of its log:\n  node2: the cause\n\Z",
                     launch.err, re.M), launch.err
    assert_nothing_left(cluster, launch)
    ended = tmp_path / "first-host-ended"
    torchrun.write_text(f"""#!/bin/sh\ncase "$*" in
  *is_host=1*) echo 'ValueError: the cause'; env -u LAUNCH_JOB sleep 3 & touch {ended}; exit 1 ;;
  *) until [ -e {ended} ]; do sleep 0.05; done
    echo 'torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection'; exit 1 ;;
esac\n""")
    launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--torchrun", torchrun,
                                hostfile(tmp_path, "node1", "node2"), "1", "train.py"], launch_env(cluster))
    assert launch.proc.returncode == 1
    assert launch.err.endswith(
        "launch.sh: node2 failed first (exit 1): its torchrun lost the rendezvous store, which node1's serves; "
        "node1 ended by itself (exit 1), and the end of its log may say why:\n  node1: ValueError: the cause\n"
    ), launch.err
    assert_nothing_left(cluster, launch)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["INT", "TERM", "HUP"])
def test_a_signal_stops_every_host(cluster, tmp_path, start, signum):
    """Ctrl-C (to the whole group, node1 reached through a ControlMaster, whose ssh clients
    end at a Ctrl-C even where it is ignored), SIGTERM (to the group and the ssh clients, as
    systemd and Slurm send it) or SIGHUP (the terminal closed): the hosts stop, what they
    say as they stop still arrives, and nothing is left."""
    torchrun = stand_in_that_stops_slowly(tmp_path)
    ssh = cluster.ssh_command
    with contextlib.ExitStack() as stack:
        if signum == signal.SIGINT:
            ssh = stack.enter_context(cluster.ssh_through_control_masters(tmp_path / "ssh_config", ["node1"]))
            assert run([*ssh.split(), "node1", "true"], timeout=30).returncode == 0  # the master, first
        launch = start(["--log-dir", tmp_path / "logs", "--torchrun", torchrun, hostfile(tmp_path, "localhost",
                        "node1"), "1", "train.py"], launch_env(cluster, SSH_COMMAND=ssh))
        launch.wait_for(r"^localhost: started\n(.*\n)*node1: started$|^node1: started\n(.*\n)*localhost: started$")
        os.killpg(launch.pid, signum)
        if signum == signal.SIGTERM:  # to the ssh clients too, as systemd and Slurm send it
            for pid in launch.processes():
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/comm").read_text() == "ssh\n":
                        os.kill(pid, signal.SIGTERM)
        assert launch.wait(20) == 128 + signum, launch.err
        for host in ("localhost", "node1"):
            assert re.search(rf"^{host}: stopping\n(.*\n)*{host}: stopped$", launch.out, re.M), launch.out
            assert re.search(rf"^  {host} +143 .*stopped by launch.sh", launch.err, re.M), launch.err
        assert "launch.sh: stopping the job on every host (signal again to stop waiting)" in launch.err
        assert until(lambda: not [argv for host in cluster.hosts for _, argv in cluster.processes(host)
                                  if argv and not argv[0].startswith("sshd")], 15), "left on a host"
        assert until(lambda: not launch.processes() and not launch.job_processes(), 10), "left here"


def test_a_killed_launcher_ends_the_job_on_every_host(cluster, tmp_path, start):
    """kill -9: each host's stdin closes. The clean-up needs no tool of the job's PATH."""
    env_file = tmp_path / "env"
    env_file.write_text("PATH=/venv/bin:$PATH\n")  # taken as written
    launch = start_sleeping_job(start, tmp_path, ["localhost", "node1", "node2"], launch_env(cluster),
                                ["--env-file", env_file])
    os.kill(launch.pid, signal.SIGKILL)
    launch.proc.wait()
    assert_nothing_left(cluster, launch)


def test_only_the_jobs_own_processes_are_stopped(cluster, tmp_path, start):
    """Two jobs on the same hosts: stopping one leaves the other running."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = start_sleeping_job(start, tmp_path / "a", ["localhost", "node1"], launch_env(cluster))
    second = start_sleeping_job(start, tmp_path / "b", ["localhost", "node1"], launch_env(cluster))
    os.kill(first.pid, signal.SIGTERM)
    assert first.wait(20) == 143, first.err
    assert until(lambda: not first.job_processes(), 10)
    sleeping = [argv for _, argv in cluster.processes("node1") if argv == ["/bin/sleep", "600"]]
    assert len(sleeping) == 1 and second.job_processes() and second.proc.poll() is None, sleeping
    os.kill(second.pid, signal.SIGTERM)
    assert second.wait(20) == 143, second.err
    assert_nothing_left(cluster, second)


def test_a_stopped_launcher_is_taken_for_gone(cluster, tmp_path, start):
    """Running, launch.sh's heartbeats keep the hosts going past LAUNCH_SILENCE_SECONDS;
    stopped (Ctrl-Z), it says nothing, and after LAUNCH_SILENCE_SECONDS the hosts stop."""
    launch = start_sleeping_job(start, tmp_path, ["node1", "node2"], launch_env(cluster, LAUNCH_SILENCE_SECONDS="4"))
    time.sleep(6)
    assert [["/bin/sleep", "600"]] * 2 == [argv for host in ("node1", "node2") for _, argv in cluster.processes(host)
                                           if argv == ["/bin/sleep", "600"]], launch.out + launch.err
    os.kill(launch.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert not cluster.wait_until_idle(20), "the job on the hosts outlived the silence"
        assert time.monotonic() - stopped > 3, "the hosts stopped before the silence"
    finally:
        os.kill(launch.pid, signal.SIGCONT)
    assert launch.wait(20) == 1, launch.err
    assert re.search(r"^launch.sh: node\d failed first \(exit 143: a SIGTERM there, or 4 s without a word from "
                     r"launch.sh \(was it stopped\?\)\)", launch.err, re.M), launch.err
    assert_nothing_left(cluster, launch)


def test_a_host_cut_off_by_the_network_stops_its_part(cluster, tmp_path, start):
    """node2's link goes down: no packet passes, no connection closes, and only the silence
    of launch.sh's heartbeat tells node2. (Here ssh gives up on it after 3 s, not 15.)"""
    env = launch_env(cluster, LAUNCH_SILENCE_SECONDS="6", SSH_COMMAND=f"{cluster.ssh_command} -o ServerAliveInterval=1")
    launch = start_sleeping_job(start, tmp_path, ["node1", "node2"], env)
    link = f"{cluster.host('node2').netns}v"  # its end on the bridge
    subprocess.run(["ip", "link", "set", link, "down"], check=True)
    try:
        assert until(lambda: ["/bin/sleep", "600"] not in [argv for _, argv in cluster.processes("node2")],
                     20), "the job on node2 outlived the silence"
        assert launch.wait(30) == 1, launch.err
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    assert re.search(r"^launch.sh: node2 failed first \(exit 255: ssh lost the connection to it", launch.err, re.M), \
        launch.err
    cluster.kill_all("node2")  # its sshd session, which TCP's retries keep a while
    assert_nothing_left(cluster, launch)


def test_a_host_whose_stop_never_ends_is_left_with_a_word(cluster, tmp_path, start):
    """Its part of the job stops, but its ssh never ends (as where a hung mount holds the
    clean-up): a second Ctrl-C, or LAUNCH_SILENCE_SECONDS of stopping, ends the wait."""
    ssh = tmp_path / "ssh-that-hangs"  # after the job's ssh (LogLevel=ERROR), not the check's
    ssh.write_text(f'#!/bin/sh\nssh -F {cluster.ssh_config} "$@"\n'
                   'case " $* " in *" LogLevel=ERROR "*) exec sleep 600 ;; esac\n')
    ssh.chmod(0o755)
    for second_signal in (True, False):
        workdir = tmp_path / str(second_signal)
        workdir.mkdir()
        launch = start_sleeping_job(start, workdir, ["node1"], launch_env(cluster, SSH_COMMAND=str(ssh),
                                                                          LAUNCH_SILENCE_SECONDS="5"))
        os.killpg(launch.pid, signal.SIGINT)
        stopping = time.monotonic()
        assert not cluster.wait_until_idle(10), "node1's part did not stop"
        assert launch.proc.poll() is None
        if second_signal:
            os.killpg(launch.pid, signal.SIGINT)
            stopping = time.monotonic()
        assert launch.wait(20) == 130, launch.err
        waited = time.monotonic() - stopping
        assert waited < 3 if second_signal else 4 < waited < 15, waited
        leaving = "at a second signal" if second_signal else "after 5 s of stopping"
        assert re.search(r"^  node1 +- +\d+  \(left stopping\)$", launch.err, re.M), launch.err
        assert launch.err.endswith(f"launch.sh: left node1 still stopping, {leaving}; part of the job may run on "
                                   f"there: 'grep -lzF LAUNCH_JOB={launch.job_id()}/ /proc/*/environ' lists its "
                                   "processes\n"), launch.err
        assert until(lambda: not launch.processes(), 5)


def test_env_forwarded_args_quoted_and_no_values_in_ps(cluster, tmp_path, start):
    """NCCL_*, GLOO_*, TORCH_* ... and --env-file reach every host through stdin: no value is
    in any program's arguments (strace sees every program launch.sh starts here, the local
    host's job too, which runs the same code as the others), however large (over a pipe's
    64 KiB, as a Spack PYTHONPATH may be). GLOO_SOCKET_IFNAME: the interface of the host's
    address, unless set (here in node1's ~/.bashrc, which also leaves a line open at the
    first login, as module systems do). The arguments reach the script as given, through
    fish and tcsh too."""
    if not shutil.which("strace"):
        skip_or_fail("strace not installed")
    secret, torch_secret = "s3cret-from-env-file-" + "x" * 70_000, "s3cret-from-environment"
    env_file = tmp_path / "env"
    env_file.write_text(f"PROBE_SECRET={secret}\n")
    bashrc = cluster.host("node1").dir / "home" / ".bashrc"  # bash reads it for ssh commands
    bashrc.write_text("export GLOO_SOCKET_IFNAME=lo\n"
                      "[ -e ~/.loaded ] || { printf 'Loading modules...'; touch ~/.loaded; }\n")
    torchrun = stand_in_torchrun(tmp_path, 'for last; do :; done\n'
                                           'echo "$(printf %s "$PROBE_SECRET" | sha256sum | cut -c1-64)'
                                           ' $TORCH_PROBE_SECRET ${LAUNCHER_ONLY-unset} $GLOO_SOCKET_IFNAME"\n'
                                           'printf "last=%s\\n" "$last"')
    trace = tmp_path / "execve.trace"
    try:
        launch = run_launch(start, ["--log-dir", tmp_path / "logs", "--env-file", env_file, "--torchrun", torchrun,
                                    hostfile(tmp_path, "localhost", "node1", "node2", "node3"), "1", "train.py",
                                    "--echo", ODD_ARG],
                            launch_env(cluster, TORCH_PROBE_SECRET=torch_secret, LAUNCHER_ONLY="here"),
                            prefix=["strace", "-f", "--seccomp-bpf", "-e", "trace=execve", "-s", "200000", "-o", trace])
    finally:
        bashrc.unlink()
        (bashrc.parent / ".loaded").unlink(missing_ok=True)
    assert launch.proc.returncode == 0, launch.out + launch.err
    execs = trace.read_text()
    assert re.search(r'execve\("[^"]*/torchrun", \["[^"]*/torchrun", "--nnodes=4"', execs)  # it saw the job
    assert re.search(r'execve\("[^"]*/ssh", ', execs)  # and the ssh clients
    assert secret[:100] not in execs and torch_secret not in execs
    bridge = subprocess.run(["ip", "-o", "addr", "show", "to", cluster.local_address], capture_output=True,
                            text=True, check=True).stdout.split()[1]
    digest = hashlib.sha256(secret.encode()).hexdigest()
    for host, interface, forwarded in (("localhost", bridge, "here"), ("node1", "lo", "unset"),
                                       ("node2", "eth0", "unset"), ("node3", "eth0", "unset")):
        assert f"{host}: {digest} {torch_secret} {forwarded} {interface}\n" in launch.out, launch.out
        assert f"{host}: last={ODD_ARG}\n" in launch.out, launch.out
    assert not (REPO / "x").exists() and not (REPO / "y").exists()
    assert_nothing_left(cluster, launch)


def test_max_restarts_restarts_every_host(cluster, tmp_path, start, mnist_dir):
    """A worker killed on node2: torchrun restarts the workers on every host, in a fresh
    rendezvous round (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and the job completes."""
    launch = start(["--log-dir", tmp_path / "logs", "--max-restarts", "1", hostfile(tmp_path, "node1", "node2"), "1",
                    "train.py", *TINY, "--data", mnist_dir, "--epochs", "1000", "--max-steps", "20"],
                   launch_env(cluster))
    launch.wait_for(r"^node\d: start: world_size=2 ", 120)

    def workers():
        return [pid for pid, argv in cluster.processes("node2")
                if "train.py" in argv and not any(a.endswith("torchrun") for a in argv)]
    (victim,) = until(workers, 30)
    os.kill(victim, signal.SIGKILL)
    assert launch.wait(180) == 0, launch.out + launch.err
    assert len(re.findall(r"^node\d: start: world_size=2 ", launch.out, re.M)) == 2, launch.out
    assert re.search(r"^node\d: epoch \d+/1000 .*test_acc", launch.out, re.M), launch.out
    assert_nothing_left(cluster, launch)
