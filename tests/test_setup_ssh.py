"""setup_ssh.sh against simulated hosts that start with password login only (node2's login
shell is fish, which parses commands unlike sh)."""

import contextlib
import os
import pty
import re
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from cluster import cluster_fixture, require_prerequisites, simulated_cluster
from conftest import linux_only, run, skip_or_fail

pytestmark = linux_only("setup_ssh.sh needs bash 4.4 or newer, and macOS's is 3.2")

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "setup_ssh.sh"
PASSWORD = secrets.token_urlsafe(12)

cluster = cluster_fixture(n_hosts=2, password=PASSWORD, authorize=False, known_hosts=False,
                          login_shells={"node2": "/usr/bin/fish"})


def setup_ssh(cluster, *args, **env):
    """setup_ssh.sh with no terminal (so it can never prompt)."""
    return run([SETUP, *args], timeout=90, env=cluster.env(**env), stdin=subprocess.DEVNULL)


def batch_login(cluster, host, key):
    return subprocess.run([*cluster.ssh_command.split(), "-i", key, "-o", "BatchMode=yes", host, "true"],
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=30).returncode


def authorized_keys(cluster, host):
    path = cluster.host(host).dir / "home/.ssh/authorized_keys"
    path.parent.mkdir(mode=0o700, exist_ok=True)
    return path


def state(*paths):
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) if p.exists() else None for p in paths}


def require_sshpass():
    if not shutil.which("sshpass"):
        skip_or_fail("sshpass not installed")


def new_key(path, passphrase=""):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", path], check=True)
    return path


def test_installs_the_key_once_and_never_overwrites_one(cluster, tmp_path):
    """Idempotent: a second run changes nothing, asks for no password. The key goes on a line
    of its own, and is not added where it is already, under any comment or options; a new
    host key is recorded (accept-new); an existing key pair is left as it is."""
    require_sshpass()
    (tmp_path / "keys").mkdir()
    key = new_key(tmp_path / "keys" / "id_ed25519")
    key_type, blob, _ = Path(f"{key}.pub").read_text().split()
    Path(f"{key}.pub").write_text(f"{key_type} {blob} me@laptop\r\n")  # as an editor may leave it
    other = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOtherKeyOtherKeyOtherKeyOtherKeyOtherKey x@y"
    node1_keys, node2_keys = (authorized_keys(cluster, h) for h in cluster.hosts)
    node1_keys.write_text(other)  # an editor that wrote no final newline
    node2_keys.write_text(f"# disabled: {key_type} {blob} me@laptop\n")  # a comment holds no key
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost  # skipped: runs without SSH\n" + "".join(f"{h}\n" for h in cluster.hosts))
    key_pair = state(key, Path(f"{key}.pub"))
    with cluster.ssh_with_an_interactive_config(tmp_path / "ssh_config") as ssh:  # which must not matter
        first = setup_ssh(cluster, "--key", key, hostfile, SSHPASS=PASSWORD, SSH_COMMAND=f"{ssh} -i {key}")
    assert first.returncode == 0, first.stdout + first.stderr
    assert first.stdout == "HOST   BATCHMODE LOGIN\nnode1  ok\nnode2  ok\n", first.stdout
    assert node1_keys.read_text() == f"{other}\n{key_type} {blob} me@laptop\n"
    assert node2_keys.read_text().endswith(f"\n{key_type} {blob} me@laptop\n")
    for host in cluster.hosts:
        assert batch_login(cluster, host, key) == 0
        ssh_dir = cluster.host(host).dir / "home/.ssh"
        assert (ssh_dir.stat().st_mode & 0o777, (ssh_dir / "authorized_keys").stat().st_mode & 0o777) == (0o700, 0o600)
        assert cluster.address(host) in cluster.known_hosts.read_text()
    assert state(key, Path(f"{key}.pub")) == key_pair
    before = state(key, Path(f"{key}.pub"), cluster.known_hosts, node1_keys, node2_keys)
    second = setup_ssh(cluster, "--key", key, hostfile, SSH_COMMAND=f"{cluster.ssh_command} -i {key}")
    assert (second.returncode, second.stdout, second.stderr) == (0, first.stdout, "")
    assert state(*before) == before
    # ssh offers another key by default: the key is there already, and login needs -i KEY
    unoffered = setup_ssh(cluster, "--key", key, hostfile)
    assert unoffered.returncode == 1
    for host in cluster.hosts:
        assert re.search(rf"^{host}  FAILED: works only with -i {key} -o IdentitiesOnly=yes: add 'IdentityFile "
                         rf"{key}' and 'IdentitiesOnly yes' for these hosts to ~/.ssh/config$", unoffered.stdout,
                         re.M), unoffered.stdout
    assert state(node1_keys, node2_keys) == {path: before[path] for path in (node1_keys, node2_keys)}


def test_the_key_is_made_or_checked_only_where_a_host_needs_it(cluster, tmp_path):
    """A host where BatchMode login works already (with a cluster's own id_rsa, say) needs
    nothing. A missing key is made once a host needs it: named id_ecdsa, an ECDSA key (FIPS
    mode refuses ed25519). One that BatchMode cannot use is one line, and nothing changes."""
    works, needs_key = cluster.hosts
    authorized = authorized_keys(cluster, works)
    authorized.write_text(Path(f"{cluster.key}.pub").read_text())  # the key that ssh offers
    try:
        for given, error in [
            ("missing", None),
            ("with_passphrase", "{key} has a passphrase, and no ssh-agent holds it: run 'ssh-add {key}' first"),
            ("open_to_others", "{key} is open to other users, so ssh ignores it: chmod 600 {key}"),
            ("without_pub", "no {key}.pub: --key takes a private key with its public key beside it "
                            "('ssh-keygen -y -f {key} > {key}.pub' writes it)"),
        ]:
            key = tmp_path / given / "id_ecdsa"
            if given != "missing":
                key.parent.mkdir()
                new_key(key, "phrase" if given == "with_passphrase" else "")
                key.chmod(0o644 if given == "open_to_others" else 0o600)
                if given == "without_pub":
                    Path(f"{key}.pub").unlink()
            before = state(authorized, key)
            hostfile = tmp_path / "hosts.txt"
            hostfile.write_text(f"{works}\n")
            result = setup_ssh(cluster, "--key", key, hostfile, SSH_AUTH_SOCK="")  # no agent, no password
            assert (result.returncode, result.stdout, result.stderr) == (0, f"HOST   BATCHMODE LOGIN\n{works}  ok\n",
                                                                       ""), given
            assert state(authorized, key) == before, given
            hostfile.write_text(f"{works}\n{needs_key}\n")
            result = setup_ssh(cluster, "--key", key, hostfile, SSH_AUTH_SOCK="")
            if error is None:
                assert result.returncode == 1, result.stdout + result.stderr
                assert re.search(rf"^{needs_key}  FAILED: .*Permission denied", result.stdout, re.M), result.stdout
                fingerprint = subprocess.run(["ssh-keygen", "-l", "-f", key], capture_output=True, text=True)
                assert fingerprint.stdout.rstrip().endswith("(ECDSA)"), fingerprint.stdout
            else:
                assert (result.returncode, result.stdout) == (2, ""), given
                assert result.stderr == f"setup_ssh.sh: {error.format(key=key)}\n"
                assert state(authorized, key) == before, given
    finally:
        authorized.unlink()  # the other tests' hosts start with password login only


def test_only_a_refused_key_falls_back_to_a_password(cluster, tmp_path):
    """A host that cannot be reached at all is reported, not asked for a password; a wrong
    password is reported too."""
    require_sshpass()
    key = tmp_path / "id_ed25519"
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{cluster.hosts[0]}:1\n{cluster.hosts[1]}\n")  # no sshd on port 1
    result = setup_ssh(cluster, "--key", key, hostfile, SSHPASS="wrong password")
    assert result.returncode == 1
    assert re.search(rf"^{cluster.hosts[0]}:1  FAILED: .*Connection refused$", result.stdout, re.M), result.stdout
    assert re.search(rf"^{cluster.hosts[1]}    FAILED: .*Permission denied", result.stdout, re.M), result.stdout
    assert result.stderr.splitlines()[-1] == f"setup_ssh.sh: {cluster.hosts[1]}: installing {key}.pub with a " \
                                             "password login", result.stderr
    assert "node1:1: installing" not in result.stderr
    assert batch_login(cluster, cluster.hosts[1], key) != 0


@contextlib.contextmanager
def ssh_agent_holding(keys, passphrase, tmp_path):
    """An ssh-agent of this test's own, holding keys; yields its SSH_AUTH_SOCK."""
    socket_path = tmp_path / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", socket_path], stdout=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        askpass = tmp_path / "askpass"
        askpass.write_text(f"#!/bin/sh\necho '{passphrase}'\n")
        askpass.chmod(0o700)
        for _ in range(100):
            if socket_path.exists():
                break
            time.sleep(0.05)
        subprocess.run(["ssh-add", *keys], env={**os.environ, "SSH_AUTH_SOCK": str(socket_path),
                       "SSH_ASKPASS": str(askpass), "SSH_ASKPASS_REQUIRE": "force"},
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=10, check=True)
        yield str(socket_path)
    finally:
        agent.kill()
        agent.wait()


def test_a_key_with_a_passphrase_is_used_through_ssh_agent(cluster, tmp_path):
    """Another key that ssh offers, with a passphrase, which the hosts accept, must not stall
    the password login: ssh would ask for that passphrase, and sshpass answers only a
    password's prompt."""
    require_sshpass()
    key, other_key = new_key(tmp_path / "id_ed25519", "phrase"), new_key(tmp_path / "id_other", "phrase")
    for host in cluster.hosts:
        authorized_keys(cluster, host).write_text(Path(f"{other_key}.pub").read_text())
    with ssh_agent_holding([key], "phrase", tmp_path) as agent:
        result = setup_ssh(cluster, "--key", key, cluster.write_hostfile(tmp_path / "hosts.txt"), SSHPASS=PASSWORD,
                           SSH_AUTH_SOCK=agent, SSH_COMMAND=f"{cluster.ssh_command} -i {other_key} -i {key}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == "HOST   BATCHMODE LOGIN\nnode1  ok\nnode2  ok\n", result.stdout


def test_a_login_that_hangs_through_a_control_master_is_given_up_after_30_s(tmp_path):
    """There ssh hands its output to the master, which holds it open until the login ends."""
    require_prerequisites()
    with (simulated_cluster(1) as fabric,
          fabric.ssh_through_control_masters(tmp_path / "ssh_config", ["node1"]) as ssh):
        opened = run([*ssh.split(), "node1", "true"], timeout=30)  # the master, before the login hangs
        assert opened.returncode == 0, opened.stderr
        (fabric.host("node1").dir / "home/.bashrc").write_text("sleep 120\n")
        started = time.monotonic()
        result = setup_ssh(fabric, "--key", tmp_path / "id_ed25519", fabric.write_hostfile(tmp_path / "hosts.txt"),
                           SSH_COMMAND=ssh)
        took = time.monotonic() - started
    assert result.returncode == 1
    assert result.stdout.splitlines()[1:] == ["node1  FAILED: no answer within 30 s (a login that hangs: a slow "
                                              ".bashrc, a stale network mount?)"], result.stdout + result.stderr
    assert took < 45, took  # once, not again for the table


def test_ctrl_c_in_a_terminal_stops_a_login_that_hangs(cluster, tmp_path):
    """timeout(1) without --foreground would run ssh out of Ctrl-C's reach for 30 s. The run
    stops there, 130, rather than going on to the next host as if the login were refused."""
    home = cluster.host(cluster.hosts[0]).dir / "home"
    authorized_keys(cluster, cluster.hosts[0]).write_text(Path(f"{cluster.key}.pub").read_text())
    (home / ".bashrc").write_text("touch ~/login_started; sleep 120\n")
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt")
    pid, terminal = pty.fork()
    if pid == 0:  # in a session of its own, with the terminal as its controlling one
        try:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # as a shell's foreground job has it
            os.execve(SETUP, [SETUP, "--key", tmp_path / "id_ed25519", hostfile], cluster.env())
        finally:
            os._exit(127)  # never a second pytest, should execve fail
    try:
        deadline = time.monotonic() + 20
        while not (home / "login_started").exists():
            assert time.monotonic() < deadline, "the login never started"
            time.sleep(0.1)
        os.write(terminal, b"\x03")  # Ctrl-C
        deadline = time.monotonic() + 10
        while (ended := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            assert time.monotonic() < deadline, "Ctrl-C did not stop setup_ssh.sh"
            time.sleep(0.1)
        pid = None
        assert os.WIFEXITED(ended[1]) and os.WEXITSTATUS(ended[1]) == 130
    finally:
        if pid:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(terminal)
        for path in (".bashrc", "login_started", ".ssh/authorized_keys"):  # as the other tests need
            (home / path).unlink(missing_ok=True)


def test_refusals_that_no_key_mends_say_why(tmp_path):
    """Slurm's pam_slurm_adopt refuses a user with no job there (in a banner, which shows
    where ssh's config says LogLevel ERROR, as the cluster's does): no key is tried. Under
    sshd's StrictModes, a home that others may write to makes it ignore the key just added."""
    require_sshpass()
    require_prerequisites()
    key = tmp_path / "id_ed25519"
    with simulated_cluster(2, password=PASSWORD, authorize=False, slurm_refuses={"node1"},
                           strict_modes=True) as odd:
        node1_keys = odd.host("node1").dir / "home/.ssh/authorized_keys"
        node1_keys.write_text(Path(f"{odd.key}.pub").read_text())  # taken, and then refused by "Slurm"
        node1_keys.chmod(0o600)
        (odd.host("node2").dir / "home").chmod(0o777)
        result = setup_ssh(odd, "--key", key, odd.write_hostfile(tmp_path / "hosts.txt"), SSHPASS=PASSWORD,
                           SSH_COMMAND=f"{odd.ssh_command} -i {key}")
        added = (odd.host("node2").dir / "home/.ssh/authorized_keys").read_text()
    assert result.returncode == 1, result.stdout + result.stderr
    assert added == Path(f"{key}.pub").read_text()
    assert result.stdout.splitlines()[1:] == [
        "node1  FAILED: Access denied by pam_slurm_adopt: you have no active jobs on this node (Slurm lets in only "
        "users with a job there: work in an allocation of them, or use train.sbatch)",
        "node2  FAILED: Permission denied to the key just added: sshd there ignores an authorized_keys that others "
        "may write to, or a directory above it (chmod go-w ~ there), or reads keys elsewhere"], result.stdout
    assert "node1: installing" not in result.stderr, result.stderr


def test_needs_no_host_and_no_ssh_for_this_machine(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    key = tmp_path / "id_ed25519"
    result = run([SETUP, "--key", key, hostfile], timeout=30, stdin=subprocess.DEVNULL)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == f"setup_ssh.sh: every host in {hostfile} is this machine, which needs no SSH: nothing to do\n"
    assert not key.exists()
    result = run([SETUP, "--key", f"{key}.pub", hostfile], timeout=30, stdin=subprocess.DEVNULL)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"setup_ssh.sh: --key takes the private key, {key}, not {key}.pub\n"
    for script in ("setup_ssh.sh", "launch.sh"):
        assert not re.search(r"StrictHostKeyChecking[= ]*no\b", (REPO / script).read_text(), re.I)


def test_a_public_key_alone_is_never_overwritten(tmp_path):
    """A .pub without its private key beside it (a hardware token's, an agent's) stays."""
    ssh = tmp_path / "refusing-ssh"  # every host refuses the keys offered
    ssh.write_text("#!/bin/sh\necho 'Permission denied (publickey).' >&2\nexit 255\n")
    ssh.chmod(0o755)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("node1\n")
    key, public = tmp_path / "id_ed25519", tmp_path / "id_ed25519.pub"
    public.write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOmt9u7ZwiYL2YbqGeXz6Ftz1QQwAPK0OAm8UWp3oB2n token\n")
    result = run([SETUP, "--key", key, hostfile], timeout=30, stdin=subprocess.DEVNULL,
                 env={"SSH_COMMAND": str(ssh)})
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == f"setup_ssh.sh: {public} has no private key {key} beside it: give --key\n"
    assert public.read_text().endswith(" token\n") and not key.exists()
