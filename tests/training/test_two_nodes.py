"""A real two-node run on one machine (issue #17 item 4): two network namespaces joined by a veth pair are the two
"nodes" (10.77.0.1 and 10.77.0.2, each with an interface named ``trid0``), and TP = 2 x PP = 2 spans them (two
processes per node, the TP pairs inside a node, the pipeline across it) over gloo. Three launches, each must give
the same losses and grad norms, bit for bit, as the single-node run of the same flags (the same ranks doing the
same arithmetic; only the transport differs):

* the ``deepspeed`` launcher on each node with ``--no_ssh --node_rank N`` (a hostfile lists both nodes);
* ``torchrun --nnodes 2 --node-rank N`` on each node;
* the ``deepspeed`` launcher on the first node alone, starting both nodes through pdsh: the other node gets a fresh
  environment (as over ssh), and DeepSpeed 0.19.8 forwards only ``NCCL*`` (CUDA), ``PYTHON*``, ``MLFLOW*``,
  ``MV2*``, ``UCX*`` and the lines of ``.deepspeed_env`` (launch directory or ``$HOME``) to it, so
  ``GLOO_SOCKET_IFNAME``, ``OMP_NUM_THREADS`` and ``DS_ACCELERATOR`` travel in that file. pdsh is not installed
  here: a stand-in (below) runs each host's command inside that host's namespace with ``env -i``.

With ``--no_ssh`` (and with torchrun) every node runs its own launcher from its own shell, and DeepSpeed reads no
``.deepspeed_env`` on that path (``runner.py`` reads it only when it starts the other nodes itself): there the
variables come from each node's environment, which is what this test gives them.

Needs root and ``ip`` (iproute2) to make the namespaces; skipped with the reason otherwise. The namespaces are
removed at the end whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
BIN = Path(PY).parent
IFNAME = "trid0"
ADDRS = ("10.77.0.1", "10.77.0.2")
FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "1", "--global-batch-size", "4", "--mock-data", "--vocab-size", "99",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--log-interval", "1", "--eval-iters", "0",
    "--train-iters", "3", "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--log-level", "WARNING",
]  # fmt: skip
NODE_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "GLOO_SOCKET_IFNAME": IFNAME}
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GLOO_SOCKET_IFNAME",
)
TIMEOUT = 120

# pdsh -S -f FANOUT -w host1,host2 CMD...: runs CMD on every host (a host here is a network namespace) in a fresh
# environment, %n replaced by the host's index; -S: exit with the largest exit code.
FAKE_PDSH = """
import subprocess, sys
args, hosts = sys.argv[1:], []
while args and args[0].startswith("-"):
    opt = args.pop(0)
    if opt in ("-f", "-w"):
        value = args.pop(0)
        hosts = value.split(",") if opt == "-w" else hosts
cmd = " ".join(args)
procs = [
    subprocess.Popen(["ip", "netns", "exec", host, "env", "-i", "PATH=/usr/bin:/bin", "HOME=" + HOME,
                      "bash", "-c", cmd.replace("%n", str(n))])
    for n, host in enumerate(hosts)
]
sys.exit(max(p.wait() for p in procs))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def nodes() -> Iterator[tuple[str, str]]:
    """Two network namespaces joined by a veth pair: (name of node 0, name of node 1)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("two-node test: needs root and iproute2 (`ip`) to create network namespaces")
    tag = os.getpid() % 100000
    names = (f"trident-n0-{tag}", f"trident-n1-{tag}")
    made: list[str] = []
    try:
        try:
            for ns in names:
                _ip("netns", "add", ns)
                made.append(ns)
            _ip("link", "add", f"trv0-{tag}", "type", "veth", "peer", "name", f"trv1-{tag}")
            for i, ns in enumerate(names):
                _ip("link", "set", f"trv{i}-{tag}", "netns", ns)
                _ip("-n", ns, "link", "set", f"trv{i}-{tag}", "name", IFNAME)
                _ip("-n", ns, "addr", "add", f"{ADDRS[i]}/24", "dev", IFNAME)
                _ip("-n", ns, "link", "set", IFNAME, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, OSError) as err:
            detail = getattr(err, "stderr", "") or str(err)
            pytest.skip(f"two-node test: cannot create network namespaces here ({detail.strip()})")
        yield names
    finally:
        for (
            ns
        ) in made:  # deleting a namespace also deletes its end of the veth pair (and so the pair)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update({"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **extra})
    return env


def _wait_all(procs: list[subprocess.Popen], logs: list[Path]) -> None:
    """Wait for every launcher; on a timeout kill their whole process groups. Asserts every one exited 0."""
    try:
        codes = [p.wait(timeout=TIMEOUT) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [None] * len(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for log in logs)
    assert codes == [0] * len(procs), tails


def _start(cmd: list[str], log: Path, *, cwd: Path = ROOT, env: dict[str, str]) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _losses(metrics: Path) -> list[tuple[float, float]]:
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    train = [r for r in rows if "lm_loss" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3], rows
    return [(r["lm_loss"], r["grad_norm"]) for r in train]


def _rx_bytes(ns: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{IFNAME}/statistics/rx_bytes"],
        capture_output=True, text=True, check=True, timeout=30,
    )  # fmt: skip
    return int(out.stdout)


@pytest.fixture(scope="module")
def single_node(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[float, float]]:
    """(lm loss, grad norm) per iteration of the same flags on one node (torchrun, 4 processes)."""
    tmp = tmp_path_factory.mktemp("single")
    metrics, log = tmp / "m.jsonl", tmp / "single.log"
    cmd = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "4", "pretrain_gpt.py"]
    _wait_all([_start([*cmd, *FLAGS, "--metrics-file", str(metrics)], log, env=_env())], [log])
    return _losses(metrics)


def _hostfile(tmp: Path, nodes: tuple[str, str]) -> Path:
    hostfile = tmp / "hostfile"
    hostfile.write_text("".join(f"{ns} slots=2\n" for ns in nodes))
    return hostfile


@pytest.mark.slow  # ~21 s
def test_deepspeed_launcher_no_ssh(nodes, single_node, tmp_path: Path) -> None:
    metrics, hostfile = tmp_path / "m.jsonl", _hostfile(tmp_path, nodes)
    before = _rx_bytes(nodes[1])
    procs, logs = [], []
    for rank, ns in enumerate(nodes):
        logs.append(tmp_path / f"node{rank}.log")
        cmd = ["ip", "netns", "exec", ns, str(BIN / "deepspeed"), "--hostfile", str(hostfile),
               "--no_ssh", "--node_rank", str(rank), "--master_addr", ADDRS[0],
               "--master_port", "29510", "pretrain_gpt.py", *FLAGS, "--metrics-file", str(metrics)]  # fmt: skip
        procs.append(_start(cmd, logs[-1], env=_env(**NODE_ENV)))
    _wait_all(procs, logs)
    assert _losses(metrics) == single_node
    assert _rx_bytes(nodes[1]) - before > 10_000  # the pipeline's activations crossed the veth pair


@pytest.mark.slow  # ~29 s (suite time, issue #33's tests): every two-node test runs with -m slow
def test_torchrun_two_nodes(nodes, single_node, tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    procs, logs = [], []
    for rank, ns in enumerate(nodes):
        logs.append(tmp_path / f"node{rank}.log")
        cmd = ["ip", "netns", "exec", ns, str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "2", "--master-addr", ADDRS[0], "--master-port", "29520",
               "pretrain_gpt.py", *FLAGS, "--metrics-file", str(metrics)]  # fmt: skip
        procs.append(_start(cmd, logs[-1], env=_env(**NODE_ENV)))
    _wait_all(procs, logs)
    assert _losses(metrics) == single_node


@pytest.mark.slow  # ~25 s
def test_deepspeed_env_reaches_the_other_node_through_pdsh(
    nodes, single_node, tmp_path: Path
) -> None:
    launch_dir, fake_bin = tmp_path / "launch", tmp_path / "bin"
    launch_dir.mkdir()
    fake_bin.mkdir()
    pdsh = fake_bin / "pdsh"
    pdsh.write_text(f"#!{PY}\nHOME = {str(tmp_path)!r}\n{FAKE_PDSH}")
    pdsh.chmod(0o755)
    # What examples/pretrain_gpt_1.3b_3d_multinode.sh writes: one VAR=value per line, nothing else (DeepSpeed
    # splits every line at its first "=": no comments, no blank lines).
    (launch_dir / ".deepspeed_env").write_text("".join(f"{k}={v}\n" for k, v in NODE_ENV.items()))
    metrics, log = tmp_path / "m.jsonl", tmp_path / "launcher.log"
    # HOME: DeepSpeed reads ~/.deepspeed_env too; only the launch directory's file is under test.
    env = _env(PATH=f"{fake_bin}:{os.environ['PATH']}", HOME=str(tmp_path))
    env.pop("OMP_NUM_THREADS")  # the nodes get these from .deepspeed_env alone
    env.pop("DS_ACCELERATOR")
    cmd = ["ip", "netns", "exec", nodes[0], str(BIN / "deepspeed"), "--hostfile",
           str(_hostfile(tmp_path, nodes)), "--no_ssh_check", "--master_addr", ADDRS[0],
           "--master_port", "29530", str(ROOT / "pretrain_gpt.py"), *FLAGS,
           "--metrics-file", str(metrics)]  # fmt: skip
    _wait_all([_start(cmd, log, cwd=launch_dir, env=env)], [log])
    text = log.read_text()
    assert f"export GLOO_SOCKET_IFNAME={IFNAME};" in text  # the pdsh command line the runner logged
    assert _losses(metrics) == single_node


def test_multinode_example_writes_the_deepspeed_env(tmp_path: Path) -> None:
    """examples/pretrain_gpt_1.3b_3d_multinode.sh writes .deepspeed_env in the launch directory before it launches,
    in a form DeepSpeed's runner reads (it splits every line at its first "="), with what pdsh would not forward.
    No namespaces needed: a stand-in ``deepspeed`` on PATH records its arguments instead of launching."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    launcher = fake_bin / "deepspeed"
    launcher.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > launched.txt\n')
    launcher.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "GLOO_SOCKET_IFNAME"}
    env.update(PATH=f"{fake_bin}:{os.environ['PATH']}", GLOO_SOCKET_IFNAME="ens5")
    script = ROOT / "examples" / "pretrain_gpt_1.3b_3d_multinode.sh"
    run = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert (tmp_path / "launched.txt").read_text().splitlines()[:2] == ["--hostfile", "hostfile"]
    lines = (tmp_path / ".deepspeed_env").read_text().splitlines()
    exported = dict(
        line.split("=", maxsplit=1) for line in lines
    )  # DeepSpeed's runner.py, line by line
    assert exported == {
        "GLOO_SOCKET_IFNAME": "ens5",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }


def _metrics_iterations(metrics: Path) -> list[int]:
    if not metrics.exists():
        return []
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip().endswith("}")]
    return [r["iteration"] for r in rows if "lm_loss" in r]


@pytest.mark.slow  # ~60 s: two rounds on two "nodes"
def test_torchrun_restart_after_one_nodes_processes_are_killed(nodes, tmp_path: Path) -> None:
    """``torchrun --nnodes 2 --max-restarts 1`` on each node (static rendezvous: the agent's store on node 0),
    --save/--load on one folder: both ranks of node 1 SIGKILLed after iteration 5. Both agents restart their ranks,
    the new round joins through the same store (its own keys, not the dead round's), resumes from `latest` and
    finishes; the replayed iterations equal the first round's."""
    import psutil

    metrics, ck = tmp_path / "m.jsonl", tmp_path / "ck"
    extra = ["--train-iters", "8", "--save-interval", "4", "--save", str(ck), "--load", str(ck),
             "--metrics-file", str(metrics)]  # fmt: skip
    procs, logs = [], []
    for rank, ns in enumerate(nodes):
        logs.append(tmp_path / f"node{rank}.log")
        cmd = ["ip", "netns", "exec", ns, str(BIN / "torchrun"), "--nnodes", "2", "--node-rank", str(rank),
               "--nproc-per-node", "2", "--max-restarts", "1", "--master-addr", ADDRS[0],
               "--master-port", "29540", "pretrain_gpt.py", *FLAGS, *extra]  # fmt: skip
        procs.append(_start(cmd, logs[-1], env=_env(**NODE_ENV)))
    deadline = time.monotonic() + TIMEOUT
    while 5 not in _metrics_iterations(metrics):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), logs[
            0
        ].read_text()[-3000:]
        time.sleep(0.05)
    first = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip().endswith("}")]
    victims = [
        c
        for c in psutil.Process(procs[1].pid).children(recursive=True)
        if "pretrain_gpt.py" in c.cmdline()
    ]
    assert len(victims) == 2
    for victim in victims:
        victim.kill()
    _wait_all(procs, logs)
    out = logs[0].read_text() + logs[1].read_text()
    assert "connectFullMesh" not in out and "torchrun restart 1 of 1" in out, out[-3000:]
    final = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    assert [r["iteration"] for r in final if "lm_loss" in r] == list(range(1, 9))
    keys = ("iteration", "lm_loss", "grad_norm", "lr")
    assert [{k: r[k] for k in keys} for r in final[: len(first)]] == [
        {k: r[k] for k in keys} for r in first
    ]
