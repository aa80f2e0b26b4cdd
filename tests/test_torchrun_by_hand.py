"""The README's command for starting torchrun by hand on every host, on two simulated hosts,
which share a filesystem but for a directory bind-mounted on one."""
import re
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from cluster import cluster_fixture
from conftest import REPO, TINY, assert_ok, metrics, run

cluster = cluster_fixture(n_hosts=2)
README_ADDRESS = "10.0.0.11"


def readme_command():
    """The command of the README's "torchrun by hand" section, as words."""
    section = (REPO / "README.md").read_text().split("### Without launch.sh", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.replace("\\\n", " ").splitlines() if not line.startswith("#")]
    (command,) = lines
    return shlex.split(command)


def torchrun_by_hand(cluster, train_args, words_left_out=()):
    """The README's command on node1 (node rank 0) and node2 (1), one process each, but for
    words_left_out; their results."""
    torchrun = Path(sys.executable).parent / "torchrun"  # the README's, on this PATH

    def on_host(node_rank, name):
        command = [re.sub(r"^--nproc-per-node=\d+$", "--nproc-per-node=1", w)
                   .replace("--node-rank=0", f"--node-rank={node_rank}")
                   .replace(README_ADDRESS, cluster.address("node1"))
                   .replace("torchrun", str(torchrun))
                   for w in readme_command() if w not in words_left_out]
        return run(cluster.command(name, ["env", *command, *train_args], cwd=REPO), timeout=120)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(on_host, [0, 1], cluster.hosts))


def test_readme_torchrun_by_hand_trains_on_two_hosts(cluster, mnist_dir, tmp_path):
    words = readme_command()
    assert words[0] == "GLOO_SOCKET_IFNAME=eth0"  # the simulated hosts' interface is eth0
    assert f"--master-addr={README_ADDRESS}" in words and "--node-rank=0" in words
    results = torchrun_by_hand(cluster, [*TINY, "--data", mnist_dir, "--max-steps", "3",
                                         "--metrics", tmp_path / "m.jsonl"])
    for result in results:
        assert_ok(result)
    (row,) = metrics(tmp_path / "m.jsonl")
    assert row["world_size"] == 2 and row["step"] == 3
    assert "start: world_size=2 backend=gloo" in results[0].stdout


def test_without_gloo_socket_ifname_every_host_stops_in_one_line(cluster, mnist_dir):
    """The simulated hosts map their names to 127.0.1.1, as Debian and Ubuntu do, where
    gloo would listen. Unchecked, one host failed at start-up and the other hung for
    minutes, past --timeout, until the run's timeout here."""
    results = torchrun_by_hand(cluster, [*TINY, "--data", mnist_dir, "--max-steps", "1"],
                               words_left_out=["GLOO_SOCKET_IFNAME=eth0"])
    for name, result in zip(cluster.hosts, results):
        assert result.returncode != 0
        assert (f"train.py: error: this host's name, {name}, gives gloo 127.0.1.1 to listen "
                f"on, where no other host can reach it: map {name} to this host's address"
                ) in result.stderr, result.stderr
        assert "start:" not in result.stdout


@pytest.mark.parametrize("rank_0s, message", [
    (None, "is on node2 but not on node1, where global rank 0 runs"),
    (4, "on node2 (step 8) is newer than on node1 (step 4), where global rank 0 runs"),
], ids=["none", "older"])
def test_a_newer_checkpoint_on_another_node_than_rank_0s_stops_the_run(cluster, mnist_dir, tmp_path,
                                                                       rank_0s, message):
    """Without a shared filesystem, last.pt is on the node that was rank 0's, or a copy is.
    Where rank 0 runs on a node with none, or an older one, it must neither start over nor
    go back: here node1 (rank 0) has a checkpoint directory of its own, and node2 step 8."""
    checkpoints, node1s = tmp_path / "checkpoints", tmp_path / "node1"
    checkpoints.mkdir()
    node1s.mkdir()
    torch.save({"step": 8}, checkpoints / "last.pt")  # all that the comparison reads
    if rank_0s is not None:
        torch.save({"step": rank_0s}, node1s / "last.pt")
    cluster.run("node1", ["mount", "--bind", node1s, checkpoints], check=True, timeout=10)
    try:
        results = torchrun_by_hand(cluster, [*TINY, "--data", mnist_dir, "--max-steps", "1",
                                             "--checkpoint-dir", checkpoints])
    finally:
        cluster.run("node1", ["umount", checkpoints], check=True, timeout=10)
    assert results[0].returncode != 0 and results[1].returncode != 0
    assert f"train.py: error: checkpoint {checkpoints}/last.pt {message}" in results[0].stderr, \
        results[0].stderr
    assert "start:" not in results[0].stdout
    assert torch.load(checkpoints / "last.pt") == {"step": 8}
