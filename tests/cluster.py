"""A simulated cluster of real SSH hosts for end-to-end tests.

Each host is a network namespace joined to a private bridge by a veth pair,
with its own address in a /24 (or a /32 each, routed="eth0" or "lo"; and one in
a private IPv6 /64 too, ipv6=True) that exists only inside this machine, its
own hostname (UTS namespace), its own /etc/hosts (naming only itself, at
127.0.1.1 as Debian does: hosts cannot resolve each other, so they must meet
by address), /etc/passwd and /etc/shadow (bind-mounted by `ip netns exec`
from /etc/netns/<ns>/) and its own sshd.
root's home on a host is a fresh directory under the cluster's temp dir, so
nothing touches the real ~/.ssh or /etc/hosts. All hosts share this
machine's filesystem and pid namespace.

Usage from a test module:

    from cluster import cluster_fixture
    cluster = cluster_fixture(n_hosts=3)          # module-scoped fixture

    def test_something(cluster):
        env = cluster.env()                        # has SSH_COMMAND set
        cluster.write_hostfile(path)               # all hosts, one per line
        cluster.processes("node2")                 # what runs on node2
        cluster.run("node2", ["hostname"])         # run inside node2
        cluster.command("node2", argv, cwd=REPO)   # argv as a command run inside node2

Or directly: `with simulated_cluster(3) as cluster: ...`.

Needs root, iproute2, util-linux (unshare, nsenter), openssh-server and
openssl (for the password hash).
Without them the fixture skips, unless REQUIRE_CLUSTER_TESTS=1, in which
case it fails.
"""

import contextlib
import dataclasses
import fcntl
import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from conftest import HIDDEN_GPUS, run, skip_or_fail

SSHD = "/usr/sbin/sshd"
_instances = 0  # clusters built by this process, for unique names
TOOLS = ("ip", "unshare", "nsenter", "ssh", "ssh-keygen", "openssl")


def missing_prerequisites(login_shells=()):
    """Return a list of reasons the cluster cannot be built here."""
    missing = [f"{shell} not installed" for shell in login_shells if not os.access(shell, os.X_OK)]
    if os.geteuid() != 0:
        missing.append("must run as root")
    missing += [f"{tool} not installed" for tool in TOOLS if not shutil.which(tool)]
    if not os.access(SSHD, os.X_OK):
        missing.append(f"{SSHD} not installed (apt-get install openssh-server)")
    return missing


def require_prerequisites(login_shells=()):
    """Skip the calling test, or fail it when REQUIRE_CLUSTER_TESTS=1."""
    missing = missing_prerequisites(login_shells)
    if not missing:
        return
    skip_or_fail("simulated cluster unavailable: " + "; ".join(missing))


def cluster_fixture(n_hosts=3, scope="module", **options):
    """Make a pytest fixture yielding a Cluster (see simulated_cluster)."""

    @pytest.fixture(scope=scope)
    def _cluster():
        require_prerequisites(options.get("login_shells", {}).values())
        with simulated_cluster(n_hosts, **options) as cluster:
            yield cluster

    return _cluster


def launched_processes(sid, mark):
    """Pids of the processes here in session sid, or whose environment holds mark
    (b"NAME=VALUE"): what a launch.sh started in its session sid and with mark in its
    environment, also what it started in sessions of their own (its ssh clients), but a
    zombie only in session sid (its environment is gone)."""
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            session = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[3])
            if session == sid or mark in Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
    return pids


def keys_no_host_knows(directory, count=6):
    """Paths of count new keys in directory: offered before the one a host takes, as many as
    sshd's MaxAuthTries (6) allows, they get ssh cut off, as an ssh-agent full of keys does."""
    keys = [Path(directory) / f"unknown_key{i}" for i in range(count)]
    for key in keys:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
    return keys


def _sh(*args, timeout=60, **kwargs):
    return subprocess.run(
        [str(a) for a in args], check=True, capture_output=True, text=True, timeout=timeout, **kwargs
    )


def _free_subnet():
    """A /24 in 10.200.0.0/13 that no route or address here overlaps."""
    used = []
    for line in _sh("ip", "-4", "-o", "route", "show", "table", "all").stdout.splitlines():
        dest = line.split()[0]
        if dest in ("default", "broadcast", "local"):
            dest = line.split()[1]
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(dest, strict=False))
    start = os.getpid() % 2048
    for i in range(2048):
        index = (start + i) % 2048
        net = ipaddress.ip_network(f"10.{200 + index // 256}.{index % 256}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("no free 10.200.0.0/13 subnet")


def _bridge_on_a_free_subnet(bridge):
    """Create `bridge`, up, at the first address of a free /24, and return the /24. The
    choice and the claim happen under a lock (on this file), so that two test processes,
    such as pytest-xdist's workers, never choose the same /24."""
    with open(__file__) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        subnet = _free_subnet()
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{next(subnet.hosts())}/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
    return subnet


@dataclasses.dataclass
class Host:
    name: str  # hostname inside the host, and its alias in ssh_config
    address: str
    netns: str
    dir: Path  # sshd config, keys, logs; home/ is root's home there
    ipv6: str | None = None  # where ssh_config sends ssh, if set

    @property
    def pidfile(self):
        return self.dir / "sshd.pid"

    def sshd_pid(self):
        return int(self.pidfile.read_text())


@dataclasses.dataclass
class Cluster:
    hosts: list  # host names, in order
    dir: Path
    ssh_config: Path
    key: Path  # private key authorized on every host (unless authorize=False)
    known_hosts: Path
    subnet: str
    local_address: str  # this machine's address on the cluster's network
    unreachable_address: str  # in the subnet, but no host answers there
    password: str | None
    _hosts: dict = dataclasses.field(repr=False)

    @property
    def ssh_command(self):
        return f"ssh -F {self.ssh_config}"

    def host(self, name):
        return self._hosts[name]

    def address(self, name):
        return self._hosts[name].address

    def env(self, **extra):
        """os.environ plus SSH_COMMAND for this cluster, plus extra. The GPUs are hidden,
        as in every test run (launch.sh and check_env.py forward that to the hosts)."""
        return {**os.environ, "SSH_COMMAND": self.ssh_command, **HIDDEN_GPUS, **extra}

    @contextlib.contextmanager
    def ssh_with_an_interactive_config(self, config, first_lines=""):
        """An SSH_COMMAND for this cluster whose config (written to path config, after
        first_lines) suits interactive logins only: it runs a command of its own (which ssh
        refuses beside one given), and forwards a port that is in use, under
        ExitOnForwardFailure: as in a ~/.ssh/config that attaches to tmux and forwards
        Jupyter's port, while the user's own session holds it."""
        with socket.create_server(("127.0.0.1", 0)) as taken:
            Path(config).write_text(f"{first_lines}RemoteCommand bash -l\n"
                                    f"LocalForward 127.0.0.1:{taken.getsockname()[1]} 127.0.0.1:22\n"
                                    f"ExitOnForwardFailure yes\nInclude {self.ssh_config}\n")
            yield f"ssh -F {config}"

    @contextlib.contextmanager
    def ssh_through_control_masters(self, config, masters, behind=()):
        """An SSH_COMMAND for this cluster whose connections to the hosts masters each share a
        ControlMaster, exited afterwards; the hosts behind are reached through masters[0]
        (ProxyJump), as through a bastion. config: the path to write its config to."""
        Path(config).write_text(f"Include {self.ssh_config}\n"
                                + (f"Host {' '.join(behind)}\n  ProxyJump {masters[0]}\n" if behind else "")
                                + f"Host {' '.join(masters)}\n  BatchMode yes\n  ControlMaster auto\n"
                                f"  ControlPath {self.dir}/cm-%C\n  ControlPersist 60\n")
        ssh = f"ssh -F {config}"
        try:
            yield ssh
        finally:
            for master in masters:
                run([*ssh.split(), "-O", "exit", master], timeout=10)

    def write_hostfile(self, path, hosts=None):
        """Write a hosts file listing hosts (default: all) one per line."""
        Path(path).write_text("".join(f"{h}\n" for h in hosts or self.hosts))
        return Path(path)

    def command(self, name, args, cwd="/"):
        """args as a command that runs inside host name's network, UTS and mount
        namespaces, in directory cwd."""
        target = str(self._hosts[name].sshd_pid())
        return ["nsenter", "-t", target, "-n", "-u", "-m", f"--wd={cwd}", "--", *map(str, args)]

    def run(self, name, args, **kwargs):
        """Run args inside host name's namespaces (see command)."""
        return subprocess.run(self.command(name, args), **kwargs)

    def processes(self, name, include_sshd=False):
        """[(pid, argv)] of every process in host name's network namespace.

        The host's listening sshd is left out unless include_sshd is set.
        """
        host = self._hosts[name]
        netns = os.stat(f"/run/netns/{host.netns}").st_ino
        sshd = None if include_sshd else host.sshd_pid()
        found = []
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit() or int(entry.name) == sshd:
                continue
            try:
                if os.stat(f"/proc/{entry.name}/ns/net").st_ino != netns:
                    continue
                argv = Path(f"/proc/{entry.name}/cmdline").read_bytes().split(b"\0")
            except OSError:  # gone meanwhile
                continue
            found.append((int(entry.name), [a.decode(errors="replace") for a in argv if a]))
        return found

    def all_processes(self):
        """{host name: processes(host)} for every host."""
        return {name: self.processes(name) for name in self.hosts}

    def wait_until_idle(self, timeout):
        """Wait until no host runs anything but its sshd; return what is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = {n: p for n, p in self.all_processes().items() if p}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def kill_all(self, name):
        """SIGKILL every process of host name except its sshd."""
        for pid, _ in self.processes(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def simulated_cluster(n_hosts=3, *, password=None, authorize=True, known_hosts=True,
                      login_shells=None, routed=None, ipv6=False, slurm_refuses=(), strict_modes=False,
                      banner=None):
    """Build n_hosts simulated SSH hosts; tear everything down on exit.

    password: if set, sshd accepts this root password (password login);
        otherwise only public keys.
    authorize: put cluster.key's public key in every host's
        ~/.ssh/authorized_keys.
    known_hosts: pre-record every host key in cluster.known_hosts
        (otherwise it starts empty).
    login_shells: {host name: root's login shell there}, e.g. /usr/bin/tcsh
        (default: this machine's, for every host). sshd runs every remote
        command through it.
    routed: each host holds its address as a /32 on this interface, with a route
        to the others through eth0: "eth0", as on routed (L3) clusters, where no
        two hosts share a subnet; "lo", as on routed fabrics that reach each
        host's loopback address (eth0 then has no IPv4 address).
    ipv6: each host also holds an address in a private IPv6 /64, where its sshd
        listens too, and ssh_config reaches it there.
    slurm_refuses: names of hosts that refuse every login as a Slurm node refuses a
        user with no job there: sshd takes the key, then PAM's account stage
        (pam_slurm_adopt's place) says no, in a message sshd sends as a banner.
    strict_modes: sshd ignores authorized_keys where others may write to it or to
        a directory above it, up to the home directory (as sshd does by default).
    banner: text every sshd sends before a login, as many sites' /etc/issue.net.
    """
    global _instances
    _instances += 1
    _remove_stale_clusters()
    tag = f"sc{os.getpid()}x{_instances}"
    base = Path(tempfile.mkdtemp(prefix=f"simcluster-{tag}-"))
    bridge = f"{tag}br"
    hosts = {}
    try:
        subnet = _bridge_on_a_free_subnet(bridge)
        addresses = [str(a) for a in subnet.hosts()]
        # A unique local (fd00::/8) /64 named after this cluster's IPv4 subnet.
        ipv6_net = ipaddress.ip_network(f"fd00:{subnet.network_address.packed[1]:x}:"
                                        f"{subnet.network_address.packed[2]:x}::/64")
        if ipv6:  # nodad: usable at once, not after duplicate address detection
            _sh("ip", "addr", "add", f"{ipv6_net[1]}/64", "dev", bridge, "nodad")
        names = [f"node{i}" for i in range(1, n_hosts + 1)]
        for i, name in enumerate(names, start=1):
            hosts[name] = Host(name, addresses[i], f"{tag}h{i}", base / name,
                               str(ipv6_net[i + 1]) if ipv6 else None)
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", base / "id_ed25519")
        for host in hosts.values():
            shell = (login_shells or {}).get(host.name)
            _start_host(host, bridge, base, password, authorize, shell, routed, subnet,
                        host.name in slurm_refuses, strict_modes, banner)
        (base / "known_hosts").write_text(
            "".join(
                f"{','.join(filter(None, (h.name, h.address, h.ipv6)))} "
                f"{(h.dir / 'ssh_host_ed25519_key.pub').read_text()}"
                for h in hosts.values()
            )
            if known_hosts
            else ""
        )
        (base / "ssh_config").write_text(
            "".join(f"Host {h.name}\n  HostName {h.ipv6 or h.address}\n" for h in hosts.values())
            + "Host *\n"
            + "  User root\n"
            + f"  IdentityFile {base / 'id_ed25519'}\n"
            + "  IdentitiesOnly yes\n"
            + f"  UserKnownHostsFile {base / 'known_hosts'}\n"
            + "  GlobalKnownHostsFile /dev/null\n"
            + "  LogLevel ERROR\n"
        )
        for host in hosts.values():
            _wait_for_sshd(host)
        yield Cluster(
            hosts=names,
            dir=base,
            ssh_config=base / "ssh_config",
            key=base / "id_ed25519",
            known_hosts=base / "known_hosts",
            subnet=str(subnet),
            local_address=addresses[0],
            unreachable_address=addresses[-1],
            password=password,
            _hosts=hosts,
        )
    finally:
        _teardown(hosts.values(), bridge, base)


def _start_host(host, bridge, base, password, authorize, login_shell, routed, subnet,
                slurm_refuses, strict_modes, banner):
    host.dir.mkdir()
    home = host.dir / "home"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    if authorize:
        keys = home / ".ssh" / "authorized_keys"
        keys.write_text((base / "id_ed25519.pub").read_text())
        keys.chmod(0o600)
    etc = Path("/etc/netns") / host.netns
    etc.mkdir(parents=True)
    # Only itself, and as Debian and Ubuntu write it: at 127.0.1.1. Hosts must meet by
    # address, as on networks without DNS, and nothing may bind to its name's address.
    (etc / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {host.name}\n")
    (etc / "passwd").write_text(
        "".join(
            _root_entry(line, home, login_shell) if line.startswith("root:") else line
            for line in Path("/etc/passwd").read_text().splitlines(keepends=True)
        )
    )
    hashed = "*"
    if password:
        hashed = _sh("openssl", "passwd", "-6", "-stdin", input=password).stdout.strip()
    (etc / "shadow").write_text(f"root:{hashed}:19000:0:99999:7:::\n")
    (etc / "shadow").chmod(0o600)
    if slurm_refuses:  # ip netns exec mounts this pam.d on /etc/pam.d, for sshd alone
        refusal = host.dir / "pam_slurm_adopt"
        refusal.write_text('#!/bin/sh\necho "Access denied by pam_slurm_adopt: you have no active '
                           'jobs on this node"\nexit 1\n')
        refusal.chmod(0o755)
        (etc / "pam.d").mkdir()
        (etc / "pam.d" / "sshd").write_text("auth required pam_deny.so\n"
                                            f"account required pam_exec.so stdout quiet {refusal}\n"
                                            "session required pam_deny.so\n"
                                            "password required pam_deny.so\n")

    _sh("ip", "netns", "add", host.netns)
    veth = f"{host.netns}v"
    _sh("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
    _sh("ip", "link", "set", veth, "master", bridge, "up")
    _sh("ip", "-n", host.netns, "link", "set", "eth0", "up")
    _sh("ip", "-n", host.netns, "link", "set", "lo", "up")  # lo's 127.0.0.1 comes first
    if routed:
        _sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/32", "dev", routed)
        _sh("ip", "-n", host.netns, "route", "add", str(subnet), "dev", "eth0")
    else:
        _sh("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
    if host.ipv6:
        _sh("ip", "-n", host.netns, "addr", "add", f"{host.ipv6}/64", "dev", "eth0", "nodad")

    key = host.dir / "ssh_host_ed25519_key"
    _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key)
    if banner is not None:
        (host.dir / "banner").write_text(banner)
    config = host.dir / "sshd_config"
    config.write_text(
        "".join(f"ListenAddress {a}\n" for a in (host.address, host.ipv6) if a)
        + f"HostKey {key}\n"
        f"PidFile {host.pidfile}\n"
        "PermitRootLogin yes\n"
        f"PasswordAuthentication {'yes' if password else 'no'}\n"
        "KbdInteractiveAuthentication no\n"
        f"UsePAM {'yes' if slurm_refuses else 'no'}\n"
        f"StrictModes {'yes' if strict_modes else 'no'}\n"
        "PrintMotd no\n"
        + (f"Banner {host.dir / 'banner'}\n" if banner is not None else "")
    )
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privsep dir
    _sh(
        "ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c",
        'hostname "$1" && exec "$2" -f "$3" -E "$4"',
        "sh", host.name, SSHD, config, host.dir / "sshd.log",
    )


def _root_entry(passwd_line, home, login_shell):
    fields = passwd_line.rstrip("\n").split(":")
    fields[5] = str(home)
    fields[6] = login_shell or fields[6]
    return ":".join(fields) + "\n"


def _wait_for_sshd(host, timeout=10):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.address, 22), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                log = (host.dir / "sshd.log").read_text() if (host.dir / "sshd.log").exists() else ""
                raise RuntimeError(f"sshd on {host.name} did not start: {log}") from None
            time.sleep(0.05)


def _delete_netns(name):
    """Kill every process in network namespace name, then delete it."""
    path = Path("/run/netns") / name
    if path.exists():
        netns = os.stat(path).st_ino
        for entry in os.scandir("/proc"):
            if entry.name.isdigit():
                with contextlib.suppress(OSError):
                    if os.stat(f"/proc/{entry.name}/ns/net").st_ino == netns:
                        os.kill(int(entry.name), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def _teardown(hosts, bridge, base):
    for host in hosts:
        with contextlib.suppress(OSError, ValueError):
            os.kill(host.sshd_pid(), signal.SIGKILL)
        _delete_netns(host.netns)
    with contextlib.suppress(OSError):
        Path("/etc/netns").rmdir()  # only if we left it empty
    subprocess.run(["ip", "link", "del", bridge], capture_output=True)
    shutil.rmtree(base, ignore_errors=True)


def _remove_stale_clusters():
    """Delete the namespaces and bridges of clusters whose process is gone
    (a test run killed before its teardown)."""
    netns = _sh("ip", "netns", "list").stdout.split()
    bridges = [
        line.split(": ")[1].split("@")[0]
        for line in _sh("ip", "-o", "link", "show", "type", "bridge").stdout.splitlines()
    ]
    for name in netns + bridges:
        owner = re.fullmatch(r"sc(\d+)x\d+(h\d+|br)", name)
        if owner and not Path(f"/proc/{owner.group(1)}").exists():
            if name.endswith("br"):
                subprocess.run(["ip", "link", "del", name], capture_output=True)
            else:
                _delete_netns(name)
    with contextlib.suppress(OSError):
        Path("/etc/netns").rmdir()  # only if empty
