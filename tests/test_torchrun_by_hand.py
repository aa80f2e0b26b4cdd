"""The README's command for starting torchrun by hand on every host, on two simulated hosts,
which share a filesystem but for a directory bind-mounted on one."""
import re
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster import cluster_fixture
from conftest import REPO, assert_ok, metrics, run

cluster = cluster_fixture(n_hosts=2)
README_ADDRESS = "10.0.0.11"


def readme_command():
    """The command of the README's "torchrun by hand" section, as words."""
    section = (REPO / "README.md").read_text().split("### Without launch.sh", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.replace("\\\n", " ").splitlines() if not line.startswith("#")]
    (command,) = lines
    return shlex.split(command)


def torchrun_by_hand(cluster, train_args):
    """The README's command on node1 (node rank 0) and node2 (1), one process each; their
    results."""
    torchrun = Path(sys.executable).parent / "torchrun"  # the README's, on this PATH

    def on_host(node_rank, name):
        command = [re.sub(r"^--nproc-per-node=\d+$", "--nproc-per-node=1", w)
                   .replace("--node-rank=0", f"--node-rank={node_rank}")
                   .replace(README_ADDRESS, cluster.address("node1"))
                   .replace("torchrun", str(torchrun)) for w in readme_command()]
        return run(cluster.command(name, ["env", *command, *train_args], cwd=REPO), timeout=120)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(on_host, [0, 1], cluster.hosts))


def test_readme_torchrun_by_hand_trains_on_two_hosts(cluster, mnist_dir, tmp_path):
    words = readme_command()
    assert words[0] == "GLOO_SOCKET_IFNAME=eth0"  # the simulated hosts' interface is eth0
    assert f"--master-addr={README_ADDRESS}" in words and "--node-rank=0" in words
    results = torchrun_by_hand(cluster, [
        "--dataset", "mnist", "--no-download", "--data", mnist_dir, "--batch-size", "16",
        "--max-steps", "3", "--metrics", tmp_path / "m.jsonl"])
    for result in results:
        assert_ok(result)
    (row,) = metrics(tmp_path / "m.jsonl")
    assert row["world_size"] == 2 and row["step"] == 3
    assert "start: world_size=2 backend=gloo" in results[0].stdout


def test_a_checkpoint_only_on_another_node_than_rank_0s_stops_the_run(cluster, tmp_path):
    """Without a shared filesystem, last.pt is on the node that was rank 0's. Where rank 0
    runs on another node now, it must not start over: here node1 (rank 0) has its own,
    empty checkpoint directory, and node2 the checkpoint."""
    checkpoints, empty = tmp_path / "checkpoints", tmp_path / "empty"
    checkpoints.mkdir()
    empty.mkdir()
    (checkpoints / "last.pt").write_bytes(b"the run so far")
    cluster.run("node1", ["mount", "--bind", empty, checkpoints], check=True, timeout=10)
    try:
        results = torchrun_by_hand(cluster, ["--arch", "cnn", "--dataset", "synthetic",
                                             "--max-steps", "1", "--checkpoint-dir", checkpoints])
    finally:
        cluster.run("node1", ["umount", checkpoints], check=True, timeout=10)
    assert results[0].returncode != 0 and results[1].returncode != 0
    assert (f"train.py: error: checkpoint {checkpoints}/last.pt is on node2 but not on node1, "
            "where global rank 0 runs") in results[0].stderr, results[0].stderr
    assert "start:" not in results[0].stdout
    assert (checkpoints / "last.pt").read_bytes() == b"the run so far"
