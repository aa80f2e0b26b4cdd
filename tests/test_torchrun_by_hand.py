"""docs/multi-node.md's command for starting torchrun by hand on every host, on two simulated hosts."""
import re
import shlex
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cluster import cluster_fixture
from conftest import REPO, TINY, assert_ok, metrics, run

cluster = cluster_fixture(n_hosts=2)
DOC_ADDRESS = "10.0.0.11"


def readme_command():
    """The command of docs/multi-node.md's "torchrun by hand" section, as words."""
    section = (REPO / "docs" / "multi-node.md").read_text().split("## Without launch.sh", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    lines = [line for line in block.replace("\\\n", " ").splitlines() if not line.startswith("#")]
    (command,) = lines
    return shlex.split(command)


def torchrun_by_hand(cluster, train_args, words_left_out=()):
    """The documented command on node1 (node rank 0) and node2 (1), one process each, but for
    words_left_out; their results."""
    torchrun = Path(sys.executable).parent / "torchrun"  # the documented one, on this PATH

    def on_host(node_rank, name):
        command = [re.sub(r"^--nproc-per-node=\d+$", "--nproc-per-node=1", w)
                   .replace("--node-rank=0", f"--node-rank={node_rank}")
                   .replace(DOC_ADDRESS, cluster.address("node1"))
                   .replace("torchrun", str(torchrun))
                   for w in readme_command() if w not in words_left_out]
        return run(cluster.command(name, ["env", *command, *train_args], cwd=REPO), timeout=120)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(on_host, [0, 1], cluster.hosts))


def test_the_documented_torchrun_by_hand_trains_on_two_hosts(cluster, mnist_dir, tmp_path):
    words = readme_command()
    assert words[0] == "GLOO_SOCKET_IFNAME=eth0"  # the simulated hosts' interface is eth0
    assert f"--master-addr={DOC_ADDRESS}" in words and "--node-rank=0" in words
    results = torchrun_by_hand(cluster, [*TINY, "--data", mnist_dir, "--max-steps", "3",
                                         "--metrics", tmp_path / "m.jsonl"])
    for result in results:
        assert_ok(result)
    (row,) = metrics(tmp_path / "m.jsonl")
    assert row["world_size"] == 2 and row["step"] == 3
    assert "start: world_size=2 backend=gloo" in results[0].stdout
