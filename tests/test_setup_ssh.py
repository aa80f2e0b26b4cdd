"""setup_ssh.sh against simulated hosts that start with password login only."""

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

import pytest

from cluster import cluster_fixture, keys_no_host_knows, require_prerequisites, simulated_cluster
from conftest import linux_only, run, skip_or_fail

pytestmark = linux_only("setup_ssh.sh needs bash 4.4 or newer, and macOS's is 3.2")

REPO = Path(__file__).resolve().parent.parent
SETUP = REPO / "setup_ssh.sh"
PASSWORD = secrets.token_urlsafe(12)

cluster = cluster_fixture(n_hosts=2, password=PASSWORD, authorize=False, known_hosts=False)


def setup_ssh(cluster, *args, **env):
    """Run setup_ssh.sh with no terminal (so it can never prompt)."""
    return run([SETUP, *args], timeout=60, env=cluster.env(**env), stdin=subprocess.DEVNULL)


def batch_login(cluster, host, key):
    return subprocess.run(
        [*cluster.ssh_command.split(), "-i", key, "-o", "BatchMode=yes", host, "true"],
        stdin=subprocess.DEVNULL, capture_output=True, timeout=30,
    ).returncode


def state(cluster, key):
    """Everything setup_ssh.sh may write: key pair, known_hosts, authorized_keys."""
    files = [key, Path(f"{key}.pub"), cluster.known_hosts]
    files += [cluster.host(h).dir / "home/.ssh/authorized_keys" for h in cluster.hosts]
    return {f: (f.read_bytes(), f.stat().st_mtime_ns) if f.exists() else None for f in files}


def keys_state(cluster, key):
    """state(), less known_hosts, which a first login writes (accept-new)."""
    return {f: v for f, v in state(cluster, key).items() if f != cluster.known_hosts}


def require_sshpass():
    if not shutil.which("sshpass"):
        skip_or_fail("sshpass not installed")


def offering(cluster, key):
    """An SSH_COMMAND whose ssh offers key, as ~/.ssh/id_ed25519 is offered by default."""
    return f"{cluster.ssh_command} -i {key}"


def test_setup_makes_batch_login_work_and_is_idempotent(cluster, tmp_path):
    require_sshpass()
    key = tmp_path / "keys" / "id_ed25519"
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost  # skipped: runs without SSH\n" + "".join(f"{h}\n" for h in cluster.hosts))
    for host in cluster.hosts:  # as the module's cluster began, whichever test ran on it before
        (cluster.host(host).dir / "home/.ssh/authorized_keys").unlink(missing_ok=True)
    assert all(batch_login(cluster, h, cluster.key) != 0 for h in cluster.hosts)

    with cluster.ssh_with_an_interactive_config(tmp_path / "ssh_config") as ssh:  # which must not matter
        first = setup_ssh(cluster, "--key", key, hostfile, SSHPASS=PASSWORD, SSH_COMMAND=f"{ssh} -i {key}")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "localhost" not in first.stdout
    for host in cluster.hosts:
        assert re.search(rf"^{host} +ok$", first.stdout, re.M), first.stdout
        assert batch_login(cluster, host, key) == 0
        ssh_dir = cluster.host(host).dir / "home/.ssh"
        assert (ssh_dir.stat().st_mode & 0o777, (ssh_dir / "authorized_keys").stat().st_mode & 0o777) == (0o700, 0o600)
        assert (ssh_dir / "authorized_keys").read_text() == Path(f"{key}.pub").read_text()
    known = cluster.known_hosts.read_text()
    assert all(cluster.address(h) in known for h in cluster.hosts), known

    before = state(cluster, key)
    second = setup_ssh(cluster, "--key", key, hostfile, SSH_COMMAND=offering(cluster, key))  # no password now
    assert second.returncode == 0, second.stdout + second.stderr
    assert second.stdout == first.stdout and second.stderr == ""
    assert state(cluster, key) == before


@pytest.mark.parametrize("given_key", ["missing", "with_passphrase", "open_to_others"])
def test_a_host_where_login_works_already_is_left_alone(cluster, tmp_path, given_key):
    """As on a cluster that made ~/.ssh/id_rsa at first login: no new key, no password, and
    nothing asked of --key until a host needs it."""
    works, needs_key = cluster.hosts
    authorized = cluster.host(works).dir / "home/.ssh/authorized_keys"
    authorized.parent.mkdir(mode=0o700, exist_ok=True)
    authorized.write_text(Path(f"{cluster.key}.pub").read_text())  # the key ssh offers
    key = tmp_path / "id_ed25519"
    if given_key != "missing":
        passphrase = "phrase" if given_key == "with_passphrase" else ""
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", passphrase, "-f", key], check=True)
        key.chmod(0o644 if given_key == "open_to_others" else 0o600)
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{works}\n")
    before = authorized.read_bytes(), authorized.stat().st_mtime_ns
    try:  # no SSHPASS: a password would fail; no ssh-agent
        result = setup_ssh(cluster, "--key", key, hostfile, SSH_AUTH_SOCK="")
        assert result.returncode == 0 and result.stderr == "", result.stdout + result.stderr
        assert re.search(rf"^{works} +ok$", result.stdout, re.M), result.stdout
        assert (authorized.read_bytes(), authorized.stat().st_mtime_ns) == before
        assert key.exists() == (given_key != "missing")
        hostfile.write_text(f"{works}\n{needs_key}\n")  # the key is made or checked once a host needs it
        result = setup_ssh(cluster, "--key", key, hostfile, SSH_AUTH_SOCK="")
        if given_key == "missing":
            assert result.returncode == 1 and key.exists()
            assert re.search(rf"^{needs_key} +FAILED: .*Permission denied", result.stdout, re.M), result.stdout
        else:
            assert (result.returncode, result.stdout) == (2, "")
            assert result.stderr == {
                "with_passphrase": f"setup_ssh.sh: {key} has a passphrase, and no ssh-agent holds it: "
                                   f"run 'ssh-add {key}' first\n",
                "open_to_others": f"setup_ssh.sh: {key} is open to other users, so ssh ignores it: "
                                  f"chmod 600 {key}\n"}[given_key]
    finally:
        authorized.unlink()  # the other tests' hosts start with password login only


def test_key_goes_on_a_line_of_its_own(cluster, tmp_path):
    require_sshpass()
    key = tmp_path / "id_ed25519"
    host = cluster.hosts[0]
    authorized = cluster.host(host).dir / "home/.ssh/authorized_keys"
    authorized.parent.mkdir(mode=0o700, exist_ok=True)
    other = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOtherKeyOtherKeyOtherKeyOtherKeyOtherKey x@y"
    with open(authorized, "a") as f:
        f.write(other)  # an editor that wrote no final newline
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{host}\n")
    result = setup_ssh(cluster, "--key", key, hostfile, SSHPASS=PASSWORD, SSH_COMMAND=offering(cluster, key))
    assert result.returncode == 0, result.stdout + result.stderr
    assert authorized.read_text().endswith(f"{other}\n{Path(f'{key}.pub').read_text()}")


@pytest.mark.parametrize("line_end", ["\r\n", ""], ids=["crlf", "no_newline"])  # as editors leave it
def test_a_key_is_added_once_under_any_comment(cluster, tmp_path, line_end):
    require_sshpass()
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    key_type, blob, _ = Path(f"{key}.pub").read_text().split()
    Path(f"{key}.pub").write_text(f"{key_type} {blob} me@laptop{line_end}")
    has_it, lacks_it = (cluster.host(h).dir / "home/.ssh/authorized_keys" for h in cluster.hosts)
    has_it.parent.mkdir(mode=0o700, exist_ok=True)
    lacks_it.parent.mkdir(mode=0o700, exist_ok=True)
    with open(lacks_it, "a") as f:
        f.write(f"# disabled: {key_type} {blob} me@laptop\n")  # a comment holds no key
    with open(has_it, "a") as f:
        f.write(f"no-pty {key_type} {blob} the-same-key-added-by-hand\n")
    before = has_it.read_bytes()
    result = setup_ssh(cluster, "--key", key, cluster.write_hostfile(tmp_path / "hosts.txt"),
                       SSHPASS=PASSWORD, SSH_COMMAND=offering(cluster, key))
    assert result.returncode == 0, result.stdout + result.stderr
    assert has_it.read_bytes() == before
    assert lacks_it.read_text().endswith(f"\n{key_type} {blob} me@laptop\n")


def test_only_a_refused_key_falls_back_to_a_password(cluster, tmp_path):
    """A host that cannot be reached at all is reported, not asked for a password."""
    key = tmp_path / "id_ed25519"
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{cluster.hosts[0]}:1\n")  # no sshd on port 1
    result = setup_ssh(cluster, "--key", key, hostfile, SSHPASS=PASSWORD)
    assert result.returncode == 1
    assert "password" not in result.stderr, result.stderr
    assert re.search(rf"^{cluster.hosts[0]}:1 +FAILED: .*Connection refused", result.stdout, re.M), result.stdout


def test_reports_hosts_where_login_fails(cluster, tmp_path):
    key = tmp_path / "id_ed25519"
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{cluster.hosts[0]}\n")
    result = setup_ssh(cluster, "--key", key, hostfile, SSHPASS="wrong password")
    assert result.returncode == 1
    assert re.search(rf"^{cluster.hosts[0]} +FAILED: .*Permission denied", result.stdout, re.M), result.stdout
    assert batch_login(cluster, cluster.hosts[0], key) != 0


@pytest.mark.parametrize("pub_given", [False, True], ids=["no_pub", "pub_given"])
def test_a_key_that_cannot_be_installed_is_one_line(cluster, tmp_path, pub_given):
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    if not pub_given:
        Path(f"{key}.pub").unlink()
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{cluster.hosts[0]}\n")
    before = keys_state(cluster, key)
    result = setup_ssh(cluster, "--key", f"{key}.pub" if pub_given else key, hostfile,
                       SSHPASS=PASSWORD)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == (
        f"setup_ssh.sh: --key takes the private key, {key}, not {key}.pub\n" if pub_given else
        f"setup_ssh.sh: no {key}.pub: --key takes a private key with its public key beside it "
        f"('ssh-keygen -y -f {key} > {key}.pub' writes it)\n")
    assert keys_state(cluster, key) == before


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
    """Without an agent it is refused before any key is installed: BatchMode logins cannot
    ask for the passphrase. With one, another key that ssh offers, which has a passphrase
    and which the hosts accept, must not stall the password login: ssh would ask for that
    passphrase, and sshpass answers only a password's prompt."""
    require_sshpass()
    key, other_key = tmp_path / "id_ed25519", tmp_path / "id_other"
    for path in (key, other_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "phrase", "-f", path], check=True)
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt")
    for host in cluster.hosts:
        (cluster.host(host).dir / "home/.ssh/authorized_keys").write_text(
            Path(f"{other_key}.pub").read_text())
    before = keys_state(cluster, key)
    without_agent = {k: v for k, v in cluster.env().items() if k != "SSH_AUTH_SOCK"}
    refused = subprocess.run([SETUP, "--key", key, hostfile], env=without_agent,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    assert (refused.returncode, refused.stdout) == (2, ""), refused.stderr
    assert refused.stderr == (f"setup_ssh.sh: {key} has a passphrase, and no ssh-agent holds it: "
                              f"run 'ssh-add {key}' first\n")
    assert keys_state(cluster, key) == before
    with ssh_agent_holding([key], "phrase", tmp_path) as agent:
        result = setup_ssh(cluster, "--key", key, hostfile, SSHPASS=PASSWORD, SSH_AUTH_SOCK=agent,
                           SSH_COMMAND=f"{cluster.ssh_command} -i {other_key} -i {key}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(re.search(rf"^{host} +ok$", result.stdout, re.M) for host in cluster.hosts), result.stdout


def test_a_host_whose_login_hangs_is_given_up_after_30_s(cluster, tmp_path):
    require_sshpass()
    key = tmp_path / "id_ed25519"
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts[:1])
    bashrc = cluster.host(cluster.hosts[0]).dir / "home/.bashrc"
    bashrc.write_text("sleep 120\n")  # bash reads it for an ssh command too
    try:
        started = time.monotonic()
        result = setup_ssh(cluster, "--key", key, hostfile, SSHPASS=PASSWORD)
        took = time.monotonic() - started
    finally:
        bashrc.unlink()
    assert_given_up_after_30_s(result, took, cluster.hosts[0])


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
    assert_given_up_after_30_s(result, took, "node1")


def assert_given_up_after_30_s(result, took, host):
    assert result.returncode == 1
    assert re.search(rf"^{host} +FAILED: no answer within 30 s \(a login that hangs",
                     result.stdout, re.M), result.stdout + result.stderr
    assert took < 45, took  # once, not again for the table


def test_ctrl_c_in_a_terminal_stops_a_login_that_hangs(cluster, tmp_path):
    """timeout(1) would run ssh outside the terminal's foreground group, out of Ctrl-C's
    reach, for 30 s, without --foreground. The run stops there, 130, rather than going on
    to the second host as if the first had refused the login."""
    hostfile = cluster.write_hostfile(tmp_path / "hosts.txt", cluster.hosts)
    home = cluster.host(cluster.hosts[0]).dir / "home"
    (home / ".ssh").mkdir(mode=0o700, exist_ok=True)
    (home / ".ssh/authorized_keys").write_text(Path(f"{cluster.key}.pub").read_text())  # ssh's own key
    (home / ".bashrc").write_text("touch ~/login_started; sleep 120\n")
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


def test_a_login_that_slurm_refuses_says_why(tmp_path):
    """pam_slurm_adopt's refusal, a banner, shows where ssh's config says LogLevel ERROR (as
    the cluster's does); no key or password helps, so none is made."""
    require_prerequisites()
    with simulated_cluster(1, slurm_refuses={"node1"}) as slurm:
        result = setup_ssh(slurm, "--key", tmp_path / "id_ed25519", slurm.write_hostfile(tmp_path / "hosts.txt"))
    assert (result.returncode, result.stderr) == (1, ""), result.stderr
    assert re.search(r"^node1 +FAILED: Access denied by pam_slurm_adopt: you have no active jobs on this node$",
                     result.stdout, re.M), result.stdout
    assert not (tmp_path / "id_ed25519").exists()


def test_a_key_that_sshd_ignores_once_added_says_why(tmp_path):
    """Under sshd's StrictModes (its default), a home that others may write to makes it
    ignore the key just added: the table says where to look. (A group's write would do on
    RHEL; Debian's sshd allows it where the group holds the user alone, as root's does.)"""
    require_sshpass()
    require_prerequisites()
    key = tmp_path / "id_ed25519"
    with simulated_cluster(1, password=PASSWORD, authorize=False, strict_modes=True) as strict:
        (strict.host("node1").dir / "home").chmod(0o777)
        result = setup_ssh(strict, "--key", key, strict.write_hostfile(tmp_path / "hosts.txt"),
                           SSHPASS=PASSWORD, SSH_COMMAND=offering(strict, key))
        added = (strict.host("node1").dir / "home/.ssh/authorized_keys").read_text()
    assert result.returncode == 1, result.stdout + result.stderr
    assert added == Path(f"{key}.pub").read_text()
    assert result.stdout.splitlines()[1:] == [
        "node1  FAILED: Permission denied to the key just added: sshd there ignores the ~/.ssh/authorized_keys "
        "that others may write to, or a directory above it (chmod go-w ~ there), or reads keys from elsewhere "
        "(AuthorizedKeysFile)"], result.stdout


def test_only_this_machine_is_nothing_to_do(tmp_path):
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost\n")
    key = tmp_path / "id_ed25519"
    result = subprocess.run([SETUP, "--key", key, hostfile], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, timeout=30)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (f"setup_ssh.sh: every host in {hostfile} is this machine, which needs "
                             "no SSH: nothing to do\n")
    assert not key.exists()


def test_never_disables_host_key_checking():
    for script in ("setup_ssh.sh", "launch.sh"):
        text = (REPO / script).read_text()
        assert not re.search(r"StrictHostKeyChecking[= ]*no\b", text, re.I)


def test_a_key_ssh_does_not_offer_is_reported(cluster, tmp_path):
    require_sshpass()
    key = tmp_path / "id_ed25519"  # cluster.ssh_command offers only cluster.key
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{cluster.hosts[1]}\n")
    result = setup_ssh(cluster, "--key", key, hostfile, SSHPASS=PASSWORD)
    assert result.returncode == 1
    assert f"FAILED: works only with -i {key}: add 'IdentityFile {key}'" in result.stdout, result.stdout
    assert batch_login(cluster, cluster.hosts[1], key) == 0


def test_an_agent_with_too_many_keys_is_reported(cluster, tmp_path):
    """ssh offers an agent's keys before the others, and sshd cuts it off after 6: the key
    installed works only where ssh offers it alone."""
    require_sshpass()
    key = tmp_path / "id_ed25519"
    config = tmp_path / "ssh_config"  # ssh offers the agent's keys, as by default
    config.write_text(cluster.ssh_config.read_text().replace("IdentitiesOnly yes\n", ""))
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{cluster.hosts[1]}\n")
    with ssh_agent_holding(keys_no_host_knows(tmp_path), "", tmp_path) as agent:
        result = setup_ssh(cluster, "--key", key, hostfile, SSHPASS=PASSWORD, SSH_AUTH_SOCK=agent,
                           SSH_COMMAND=f"ssh -F {config} -i {key}")
    assert result.returncode == 1
    assert (f"FAILED: works only with -i {key} -o IdentitiesOnly=yes (ssh offers other keys first, more "
            f"than the host takes): add 'IdentityFile {key}' and 'IdentitiesOnly yes' for these hosts "
            "to ~/.ssh/config\n") in result.stdout, result.stdout + result.stderr
    assert batch_login(cluster, cluster.hosts[1], key) == 0


def test_a_new_key_named_id_ecdsa_is_an_ecdsa_key(cluster, tmp_path):
    """FIPS mode (RHEL's) refuses ed25519 keys: a key named as ssh names its ECDSA one is the
    way out."""
    require_sshpass()
    key = tmp_path / "id_ecdsa"
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{cluster.hosts[0]}\n")
    result = setup_ssh(cluster, "--key", key, hostfile, SSHPASS=PASSWORD, SSH_COMMAND=offering(cluster, key))
    assert result.returncode == 0, result.stdout + result.stderr
    fingerprint = subprocess.run(["ssh-keygen", "-l", "-f", key], capture_output=True, text=True, check=True)
    assert fingerprint.stdout.rstrip().endswith("(ECDSA)"), fingerprint.stdout


def test_hosts_whose_login_shell_is_fish_or_tcsh(tmp_path):
    require_sshpass()
    shells = {"node1": "/usr/bin/fish", "node2": "/usr/bin/tcsh"}  # they parse unlike sh
    require_prerequisites(shells.values())
    key = tmp_path / "id_ed25519"
    with simulated_cluster(2, password=PASSWORD, authorize=False, login_shells=shells) as odd_cluster:
        result = setup_ssh(odd_cluster, "--key", key, odd_cluster.write_hostfile(tmp_path / "hosts.txt"),
                           SSHPASS=PASSWORD, SSH_COMMAND=offering(odd_cluster, key))
        assert result.returncode == 0, result.stdout + result.stderr
        for host in odd_cluster.hosts:
            assert re.search(rf"^{host} +ok$", result.stdout, re.M), result.stdout
            keys = odd_cluster.host(host).dir / "home/.ssh/authorized_keys"
            assert keys.read_text() == Path(f"{key}.pub").read_text()
