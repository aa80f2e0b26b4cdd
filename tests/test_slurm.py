"""train.sbatch end to end on a simulated SLURM cluster (tests/slurm_cluster.py): slurmctld
here and a slurmd on each of two hosts, network namespaces of their own. Skips without root,
slurm-wlm or munge, unless REQUIRE_CLUSTER_TESTS=1."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY, TRAIN, assert_ok, load, run, torchrun
from slurm_cluster import slurm_fixture

SBATCH = REPO / "train.sbatch"
slurm = slurm_fixture(n_hosts=2)

# The README's SLURM lines, run here as written (JOBID: the number sbatch printed).
README_LINES = ((REPO / "README.md").read_text().split("## SLURM\n", 1)[1]
                .split("```bash\n", 1)[1].split("```", 1)[0].splitlines())


@pytest.fixture(autouse=True)
def no_job_left(request):
    """Each test on the cluster leaves idle nodes to the next, whatever happened."""
    yield
    if "slurm" in request.fixturenames:
        assert not request.getfixturevalue("slurm").cancel_all(), "a job's processes outlived scancel"


def job_env(slurm, **extra):
    """What sbatch passes on to every node: this venv's torchrun first on PATH, plus extra."""
    return slurm.env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", **extra)


def paused_train(tmp_path, target, calls=1):
    """(script, marker): train.py, but its job's first run (not one after a requeue) touches
    marker and sleeps after its calls-th call of target ("module.function"): mid-run for certain."""
    module, name = target.rsplit(".", 1)
    script, marker = tmp_path / "paused_train.py", tmp_path / "paused"
    script.write_text(f"""\
import importlib, os, pathlib, sys, time
sys.path.insert(0, {str(REPO)!r})
import train
owner = importlib.import_module({module!r})
original, made = getattr(owner, {name!r}), []
def then_pause(*args, **kwargs):
    result = original(*args, **kwargs)
    made.append(1)
    if os.environ.get("SLURM_RESTART_COUNT", "0") == "0" and len(made) == {calls}:
        pathlib.Path({str(marker)!r}).touch()
        time.sleep(600)
    return result
setattr(owner, {name!r}, then_pause)
train.main(sys.argv[1:])
sys.stdout.flush()
os._exit(0)
""")
    return script, marker


def wait_until(condition, timeout, what):
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)
    return result


def workers(slurm, script, count):
    """{node: [(pid, argv)]} of the ranks running script, once each node has count of them."""
    found = {node: [(pid, argv) for pid, argv in slurm.job_processes(node)
                    if argv[1:3] == ["-u", str(script)]]  # as torchrun starts them
             for node in slurm.nodes}
    return found if all(len(ranks) == count for ranks in found.values()) else None


def environ(pid):
    return dict(entry.split("=", 1) for entry in
                Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in entry)


def test_usage_errors_are_one_line_and_exit_2():
    for args, env, error in [
        (["2"], {"SLURM_JOB_ID": "", "SLURMD_NODENAME": ""}, "not in a SLURM batch job: submit it with sbatch"),
        (["2"], {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": ""}, "not in a SLURM batch job"),  # salloc's shell
        (["train.py"], {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1"},
         "NPROC_PER_NODE must be a number, gpu, cpu or auto, not train.py"),
        (["2", "--epochs", "3"], {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "n1"}, "SCRIPT comes before its arguments"),
    ]:
        result = run(["bash", SBATCH, *args], env=env, timeout=30)
        assert (result.returncode, result.stdout) == (2, ""), result
        assert result.stderr.startswith(f"train.sbatch: {error}") and result.stderr.count("\n") == 1


def test_a_usage_error_in_a_job_is_its_one_line_and_exit_2(slurm, tmp_path):
    job = slurm.sbatch(["--nodes=1", SBATCH], cwd=tmp_path, **job_env(slurm))
    assert slurm.wait_for(job, "FAILED", timeout=30)["ExitCode"] == "2:0"
    output = slurm.output(tmp_path, job)
    assert output.startswith("train.sbatch: NPROC_PER_NODE must be a number") and output.count("\n") == 1


def test_readme_lines_run_as_written_and_scancel_leaves_nothing(slurm, tmp_path, mnist_dir):
    for name, target in [("train.sbatch", SBATCH), ("train.py", TRAIN), ("data", mnist_dir)]:
        (tmp_path / name).symlink_to(target)

    def line(i, job="", prefix=""):
        result = run(["bash", "-c", prefix + README_LINES[i].replace("JOBID", job)], cwd=tmp_path,
                     env=job_env(slurm), timeout=30)
        assert result.returncode == (124 if prefix else 0), result
        return result.stdout

    job = line(0).removeprefix("Submitted batch job ").strip()
    assert job.isdigit()
    assert job in line(1)
    wait_until(lambda: workers(slurm, "train.py", 4), 60, "4 ranks on every node")
    fields = slurm.job(job)
    assert (fields["OverSubscribe"], fields["NumCPUs"]) == ("NO", "4")  # whole nodes, 2 CPUs each
    output = line(2, prefix="timeout 2 ")  # tail -f follows until stopped
    assert "0: node1 (" in output and "1: node2 (" in output
    start = time.monotonic()
    line(3, job)
    assert not slurm.wait_until_idle(15), "processes left 15 s after scancel"
    print(f"scancel to idle nodes: {time.monotonic() - start:.1f} s")
    assert slurm.wait_for(job, "CANCELLED", timeout=15)


def test_a_rank_killed_fails_the_whole_job_fast(slurm, tmp_path, mnist_dir):
    """Killed while the others sleep, not in a collective that would fail them: only srun's
    --kill-on-bad-exit ends them."""
    script, paused = paused_train(tmp_path, "torch.distributed.init_process_group")
    job = slurm.sbatch(["--nodes=2", SBATCH, "2", script, *TINY, "--data", mnist_dir],
                       cwd=tmp_path, **job_env(slurm))
    ranks = wait_until(lambda: paused.exists() and workers(slurm, script, 2), 90, "paused ranks")
    addresses = {node: slurm.cluster.address(node) for node in slurm.nodes}
    port, torchrun_path = 20000 + int(job) % 10000, str(Path(sys.executable).parent / "torchrun")
    for node, found in ranks.items():
        assert environ(found[0][0])["GLOO_SOCKET_IFNAME"] == "eth0"
        torchrun_argv = next(argv for _, argv in slurm.job_processes(node) if argv[1:2] == [torchrun_path])
        for arg in [f"--rdzv-endpoint={addresses['node1']}:{port}", f"--rdzv-id={job}",
                    f"--local-addr={addresses[node]}", f"--rdzv-conf=is_host={int(node == 'node1')}"]:
            assert arg in torchrun_argv
    start = time.monotonic()
    os.kill(ranks["node2"][0][0], signal.SIGKILL)
    assert slurm.wait_for(job, "FAILED", timeout=30)
    assert not slurm.wait_until_idle(30 - (time.monotonic() - start)), "processes left"
    print(f"kill -9 to failed job and idle nodes: {time.monotonic() - start:.1f} s")
    output = slurm.output(tmp_path, job)
    assert "train.sbatch: no --checkpoint-dir: after a requeue" in output
    assert any(line.startswith("1: ") and "SIGKILL" in line for line in output.splitlines())


def test_usr1_requeues_and_the_job_resumes_bitwise_equal_to_4_standalone_ranks(slurm, tmp_path,
                                                                                 mnist_dir):
    args = [*TINY, "--data", mnist_dir, "--epochs", "2", "--save-every", "4"]  # 16 steps
    script, paused = paused_train(tmp_path, "train.save_checkpoint", calls=2)  # step 0's, step 4's
    ckpt = tmp_path / "slurm" / "last.pt"
    job = slurm.sbatch(["--nodes=2", SBATCH, "2", script, *args, "--checkpoint-dir", ckpt.parent],
                       cwd=tmp_path, **job_env(slurm))
    wait_until(paused.exists, 90, "save at step 4")
    assert load(ckpt)["step"] == 4
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], env=slurm.env(), check=True, timeout=30)
    with concurrent.futures.ThreadPoolExecutor() as pool:  # while SLURM requeues
        standalone = pool.submit(torchrun, 4, *args, "--checkpoint-dir", tmp_path / "standalone")
        state = slurm.wait_for(job, "COMPLETED", timeout=150)
        assert_ok(standalone.result())
    assert state["Restarts"] == "1"
    output = slurm.output(tmp_path, job)
    head = slurm.cluster.address("node1")
    for expected in [f"job {job}, run 0, on 2 nodes; rendezvous at {head}:{20000 + int(job) % 10000}\n",
                     f"requeueing job {job}\n", f"job {job}, run 1, on 2 nodes",
                     f"0: node1 ({head}, gloo on eth0): torchrun\n",
                     f"1: node2 ({slurm.cluster.address('node2')}, gloo on eth0): torchrun\n",
                     f"0: resumed from {ckpt} at step 4\n", "0: done: step 16/16"]:
        assert expected in output
    ends = load(ckpt), load(tmp_path / "standalone" / "last.pt")
    assert ends[0]["step"] == ends[1]["step"] == 16
    different = [k for k in ends[1]["model"] if not torch.equal(ends[0]["model"][k], ends[1]["model"][k])]
    assert ends[0]["model"].keys() == ends[1]["model"].keys() and not different, f"differ: {different}"
    momenta = [[s["momentum_buffer"] for s in end["optimizer"]["state"].values()] for end in ends]
    assert momenta[0] and len(momenta[0]) == len(momenta[1]) and all(map(torch.equal, *momenta))


def test_check_env_slurm_names_the_node_whose_torch_differs(slurm, tmp_path):
    """node2's torch says another version: a sitecustomize.py on PYTHONPATH there alone."""
    shim, other = tmp_path / "shim", tmp_path / "other_torch"
    shim.mkdir()
    other.mkdir()
    (other / "sitecustomize.py").write_text("import torch\ntorch.__version__ = '2.99.0'\n")
    with slurm.bind_mount("node2", other, shim):
        result = run(["salloc", "--nodes=2", sys.executable, REPO / "check_env.py", "--slurm"],
                     env=job_env(slurm, PYTHONPATH=str(shim)), timeout=120)
    assert result.returncode == 1, result
    [problem] = [p for p in result.stdout.partition(" problem(s):\n")[2].splitlines() if "torch" in p]
    assert problem.startswith("node2: torch 2.99.0 ") and f"node1 ({torch.__version__})" in problem
