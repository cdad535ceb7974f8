"""--async-save: the snapshot, the commit only once every rank's files are written, one save in flight, a failed
background write, and (slow) SIGKILLs during the background write of ``pretrain_gpt.py`` runs.

The protocol test runs two real ranks (gloo, ZeRO-1, DP 2) with the real DeepSpeed engine; rank 1's writer is held
back by an event (fault injection: the writer thread waits before it starts) to show that neither rank commits
while one rank is still writing.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron.checkpointing.async_save import snapshot
from megatron.testing import run_distributed

FLAGS = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--vocab-size", "1000", "--tokenizer-type", "NullTokenizer",
    "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "2",
    "--lr", "1e-4", "--zero-stage", "1", "--log-level", "WARNING", "--async-save",
]  # fmt: skip


def test_snapshot_is_a_private_host_copy() -> None:
    """The structure is copied at once, the tensors by ``copy()`` (later in-place changes do not reach them);
    types and attributes are kept; the next snapshot reuses the host buffers."""
    w = torch.nn.Parameter(torch.arange(6.0).view(2, 3))
    flat = torch.zeros(8)
    sd: Any = collections.OrderedDict(weight=w.detach(), view=flat[2:5])
    sd._metadata = {"": {"version": 1}}
    state = {"module": sd, "param": w, "groups": [{"lr": 0.1, "t": (flat, 3)}], "n": 7}
    snap = snapshot(state)
    state["groups"][0]["lr"] = 0.2  # not a tensor: copied at snapshot time
    snap.copy()
    w.data.add_(100.0)
    flat.add_(1.0)
    got = snap.state
    assert torch.equal(got["module"]["weight"], torch.arange(6.0).view(2, 3))
    assert torch.equal(
        got["module"]["view"], torch.zeros(3)
    )  # a view becomes a tensor of its own size
    assert got["module"]._metadata == {"": {"version": 1}}
    assert isinstance(got["module"], collections.OrderedDict)
    assert isinstance(got["param"], torch.nn.Parameter) and got["param"].requires_grad
    assert torch.equal(got["groups"][0]["t"][0], torch.zeros(8)) and got["groups"][0]["t"][1] == 3
    assert got["groups"][0]["lr"] == 0.1 and got["n"] == 7
    again = snapshot(state, buffers=snap.buffers)  # the next save copies into the same host memory
    assert [b.data_ptr() for b in again.buffers] == [b.data_ptr() for b in snap.buffers]


def _inject(write_gate: threading.Event, copy_gate: threading.Event) -> None:
    """Fault injection: every rank's copies wait for ``copy_gate``; rank 1's file writes wait for ``write_gate``
    and, once ``_FAIL`` is set, fail as a full disk does."""
    from megatron.checkpointing import async_save, checksums

    copy = async_save.Snapshot.copy

    def late_copy(self: Any) -> None:
        copy_gate.wait()
        copy(self)

    async_save.Snapshot.copy = late_copy  # type: ignore[method-assign]
    if int(os.environ["RANK"]) != 1:
        return
    save = checksums.ChecksumRecorder.torch_save

    def held(self: Any, state_dict: Any, path: Any, zipped: bool) -> None:
        write_gate.wait()
        if _FAIL:
            raise OSError(28, "No space left on device", str(path))
        save(self, state_dict, path, zipped)

    checksums.ChecksumRecorder.torch_save = held  # type: ignore[method-assign]


_FAIL: list[bool] = []


def _step(engine: Any) -> None:
    """An optimizer step (on a loss of the parameters alone): changes every parameter in place."""
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-2  # the schedule is not applied here; its first LR may be 0
    loss = sum((p.float() ** 2).sum() for p in engine.module.parameters())
    engine.backward(loss)
    engine.step()


def _setup(save: str, *extra: str) -> tuple[Any, Any, Any, Any]:
    from megatron.config import parse_args
    from megatron.training import initialize, preflight
    from megatron.training.lr_scheduler import build_lr_scheduler
    from megatron.training.model_setup import build_engine

    pre = preflight(parse_args([*FLAGS, "--save", save, "--load", save, *extra]))
    cfg, plan = pre.cfg, pre.plan
    run = initialize.init_distributed(cfg.parallel)
    bundle = build_engine(cfg.model, cfg.training, cfg.parallel, plan, pre.ds_config, run)
    sched = build_lr_scheduler(cfg.training, plan.global_batch_size, bundle.client_optimizer)
    return pre, run, bundle.engine, sched


def _first_save(root: Path, ck: Any, engine: Any, sched: Any, out: dict[str, Any]) -> list:
    """Save 1 with the copies held for 0.5 s and rank 1's writes until released: the step after it waits for
    the copies; no rank commits while rank 1 writes. Returns the parameters as saved."""
    from megatron.checkpointing.checksums import verify_checkpoint_files
    from megatron.checkpointing.meta import read_meta
    from megatron.training.state import TrainState

    write_gate, copy_gate = threading.Event(), threading.Event()
    _inject(write_gate, copy_gate)
    saved = [p.detach().clone() for p in engine.module.parameters()]
    state = TrainState()
    state.iteration = 1
    ck.save(engine, sched, state)
    threading.Timer(0.5, copy_gate.set).start()
    _step(engine)  # training goes on; its optimizer step must wait for the copies
    out["step_waited"] = ck._async.step_wait_seconds
    out["changed"] = not all(torch.equal(p, s) for p, s in zip(engine.module.parameters(), saved))
    ck.finalize_save(blocking=False)  # rank 0 has written its files, rank 1 not: no commit
    out["latest_while_rank1_writes"] = (root / "latest").exists()
    out["marker_while_rank1_writes"] = (root / "global_step1" / "trident_meta.json").exists()
    write_gate.set()
    ck.finalize_save(blocking=True)
    out["latest_after"] = (root / "latest").read_text()
    out["verified"] = verify_checkpoint_files(
        root / "global_step1", read_meta(root, "global_step1")
    )
    out["sidecars_left"] = sorted(p.name for p in (root / "global_step1").glob(".checksums*"))
    return saved


def _protocol(save: str) -> dict[str, Any]:
    """Saves 1-4 of a DP-2 ZeRO-1 engine with --async-save; what each rank saw at each point."""
    from megatron import mpu
    from megatron.checkpointing.commit import CheckpointSaveError
    from megatron.config import parse_args
    from megatron.training import preflight
    from megatron.training.pretrain import build_checkpointer
    from megatron.training.state import TrainState

    root = Path(save)
    pre, run, engine, sched = _setup(save)
    ck = build_checkpointer(pre, run)
    out: dict[str, Any] = {}
    saved = _first_save(root, ck, engine, sched, out)
    state = TrainState()
    for it in (
        2,
        3,
    ):  # one save in flight: the save of 3 waits for 2 and commits it before it starts
        state.iteration = it
        ck.save(engine, sched, state)
        out[f"latest_after_save_{it}"] = (root / "latest").read_text()
    ck.finalize_save(blocking=True)
    out["latest_final"] = (root / "latest").read_text()
    _FAIL.append(True)  # a failed background write on rank 1: every rank raises, 'latest' stays
    state.iteration = 4
    ck.save(engine, sched, state)
    try:
        ck.finalize_save(blocking=True)
        out["failure"] = None
    except CheckpointSaveError as err:
        out["failure"] = str(err)
    out["latest_after_failure"] = (root / "latest").read_text()
    # The checkpoint of iteration 1 holds the values of the moment it was saved, not the stepped ones.
    loaded = TrainState()
    pre1 = preflight(parse_args([*FLAGS, "--load", save, "--load-tag", "global_step1"]))
    build_checkpointer(pre1, run).load(engine, sched, loaded)
    out["loaded_iteration"] = loaded.iteration
    out["loaded_equal"] = all(torch.equal(p, s) for p, s in zip(engine.module.parameters(), saved))
    mpu.destroy_model_parallel()
    return out


def test_async_save_protocol(tmp_path: Path) -> None:
    save = tmp_path / "ck"
    outs = run_distributed(_protocol, 2, str(save), init_process_group=False, timeout=300)
    for rank, out in enumerate(outs):
        assert out["step_waited"] > 0.2 and out["changed"], (rank, out["step_waited"])
        assert out["latest_while_rank1_writes"] is False, rank
        assert out["marker_while_rank1_writes"] is False, rank
        assert out["latest_after"] == "global_step1"
        assert out["verified"] == 5  # model file, two ZeRO partitions, two RNG files
        assert out["sidecars_left"] == []
        assert out["latest_after_save_2"] == "global_step1"  # 2 still in flight
        assert out["latest_after_save_3"] == "global_step2"  # 3 waited for 2 and committed it
        assert out["latest_final"] == "global_step3"
        assert out["latest_after_failure"] == "global_step3"
        assert out["loaded_iteration"] == 1 and out["loaded_equal"], rank
    assert "No space left on device" in outs[1]["failure"]
    assert "global_step4" in outs[1]["failure"]
    assert (
        "rank 1" in outs[0]["failure"]
        and "'latest' still points to global_step3" in outs[0]["failure"]
    )
    assert not (save / "global_step4" / "trident_meta.json").exists()


ROOT = Path(__file__).resolve().parents[2]
KILL_ITERS = 40
KILL_FLAGS = [
    "--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8",
    "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "5000",
    "--tokenizer-type", "NullTokenizer", "--mock-data", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--lr", "2e-4", "--min-lr", "2e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--seed", "11",
    "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--log-level", "WARNING",
    "--train-iters", str(KILL_ITERS),
]  # fmt: skip


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore")
    return env


def _losses(path: Path) -> dict[int, float]:
    if not path.exists():
        return {}
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]
    return {r["iteration"]: r["lm_loss"] for r in rows if "lm_loss" in r}


def _writing(ck: Path) -> bool:
    """A tag directory without its completion marker exists: a background write is in flight."""
    return any(not (p / "trident_meta.json").exists() for p in ck.glob("global_step*"))


@pytest.mark.slow
def test_sigkill_during_background_writes_then_resume_exactly(tmp_path: Path) -> None:
    """10 SIGKILLs at random moments of a run that saves every iteration with --async-save (a write is almost
    always in flight); after each, 'latest' names a complete checkpoint and the relaunch's losses equal the
    uninterrupted run's, bit for bit."""
    from megatron.checkpointing.pointers import find_checkpoint

    script = str(ROOT / "pretrain_gpt.py")
    ref_file = tmp_path / "ref.jsonl"
    subprocess.run(
        [sys.executable, script, *KILL_FLAGS, "--metrics-file", str(ref_file)],
        env=_env(), cwd=ROOT, check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    ref = _losses(ref_file)
    assert sorted(ref) == list(range(1, KILL_ITERS + 1))
    ck = tmp_path / "ckpt"
    rng = random.Random(1234)
    in_flight_at_kill, tag = 0, None
    for trial in range(11):
        metrics = tmp_path / f"run{trial}.jsonl"
        cmd = [
            sys.executable, script, *KILL_FLAGS, "--save", str(ck), "--load", str(ck),
            "--save-interval", "1", "--async-save", "--metrics-file", str(metrics),
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stderr=subprocess.DEVNULL)
        if trial < 10:
            deadline = time.time() + 300
            while len(_losses(metrics)) < 1 + trial % 3 and time.time() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.4))
            in_flight_at_kill += _writing(ck)
            proc.send_signal(signal.SIGKILL)
        code = proc.wait(timeout=600)
        assert code == (-signal.SIGKILL if trial < 10 else 0), (trial, code)
        got = _losses(metrics)
        assert got and all(got[k] == ref[k] for k in got), (trial, got)
        previous, tag = (
            tag,
            find_checkpoint(str(ck)),
        )  # raises when 'latest' names an incomplete tag
        assert tag is not None or previous is None, trial  # none yet: only before the first commit
    assert tag == f"global_step{KILL_ITERS}"
    print(f"SIGKILLs with a background write in flight: {in_flight_at_kill} of 10")
    assert in_flight_at_kill >= 7, in_flight_at_kill


@pytest.mark.gpu
def test_snapshot_of_gpu_tensors_into_pinned_memory_on_another_thread() -> None:
    """GPU (skipped without CUDA): pinned host buffers, filled on a thread whose current device is not the
    tensors' (the writer's), equal the values at the time of the copy; later in-place changes do not reach them."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    w = torch.randn(1024, 1024, device=device)
    expected = w.cpu()
    snap = snapshot({"w": w, "m": torch.nn.Parameter(w * 2)})
    assert snap.buffers[0].is_pinned() and snap.buffers[0].device.type == "cpu"
    thread = threading.Thread(target=snap.copy)
    thread.start()
    thread.join()
    w.add_(1.0)
    torch.cuda.synchronize(device)
    assert torch.equal(snap.state["w"], expected) and torch.equal(snap.state["m"], expected * 2)
    assert isinstance(snap.state["m"], torch.nn.Parameter)
