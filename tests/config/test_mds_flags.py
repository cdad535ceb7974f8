"""Every flag of Megatron-DeepSpeed's parser is known to ours: implemented, a documented no-op, or refused by name.

The compatibility table of ``docs/megatron-deepspeed.md`` is generated from the same tables
(``scripts/mds_flag_table.py``, over the inventory ``scripts/mds_flags.py``) and must equal the generator's output; every refused flag stops the parse with its one line, and a few go through
``pretrain_gpt.py`` itself (exit 2, one ``error:`` line, before torch is imported).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.config import build_parser, config_from_namespace
from megatron.config.flags import COMPAT_NO_OPS
from megatron.config.refused import REFUSED, RefusedFlagError

ROOT = Path(__file__).resolve().parents[2]


def _script_module(name: str):
    """``scripts/<name>.py`` loaded by path and registered under its own name, as ``python scripts/...`` sees it
    (``mds_flag_table`` imports ``mds_flags`` as its sibling); ``scripts/`` is not a package."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


INVENTORY = _script_module("mds_flags")  # first: the table script imports it
TABLE = _script_module("mds_flag_table")
MDS_FLAGS, all_mds_flags = INVENTORY.MDS_FLAGS, INVENTORY.all_mds_flags
PARSER = build_parser()  # built once: building it walks every dataclass's source


def parse_args(argv: list[str]):
    return config_from_namespace(PARSER.parse_args(argv))


def test_inventory_is_their_whole_parser() -> None:
    flags = all_mds_flags()
    assert len(flags) == len(set(flags)) == 320  # 316 spellings in arguments.py + 4 of deepspeed's
    assert len(MDS_FLAGS) == 23
    for flag in (
        "--kd",
        "--cpu_torch_adam",
        "--override-opt_param-scheduler",
        "--local_rank",
        "--DDP-impl",
    ):
        assert flag in flags


def test_every_mds_flag_is_known() -> None:
    known = PARSER._option_string_actions
    assert [f for f in all_mds_flags() if f not in known] == []
    rows = TABLE.table_rows()
    assert [r[0] for r in rows] == all_mds_flags()
    assert not [r for r in rows if r[2] == "unknown"]
    # Our own tables name only Megatron-DeepSpeed flags (no typo that refuses a flag nobody passes).
    mds = set(all_mds_flags())
    for entry in REFUSED:
        assert set(entry.flags) <= mds, entry.flags
    # A flag is refused or a no-op, never both.
    no_ops = {f for c in COMPAT_NO_OPS for f in c.flags}
    refused = {f for e in REFUSED for f in e.flags}
    assert not no_ops & refused


def test_docs_table_is_the_generated_one() -> None:
    page = (ROOT / "docs" / "megatron-deepspeed.md").read_text(encoding="utf-8")
    assert TABLE.page_table(page) == TABLE.render(), (
        "docs/megatron-deepspeed.md's table is stale: paste `python scripts/mds_flag_table.py`"
    )


@pytest.mark.parametrize("entry", REFUSED, ids=lambda e: e.flags[0])
def test_refused_flag_stops_the_parse(entry) -> None:
    for flag in entry.flags:
        argv = [flag, "7"] if entry.takes_value else [flag]
        with pytest.raises(RefusedFlagError) as e:
            parse_args(["--num-layers", "2", *argv])
        line = str(e.value)
        assert line.startswith(f"{flag} is refused") and "\n" not in line
        assert entry.why in line and entry.instead in line
        if entry.takes_value:  # also with the value missing: the flag itself is what is refused
            with pytest.raises(RefusedFlagError):
                parse_args([flag])
    for value in entry.accepts:  # the "feature off" value is accepted with no effect
        assert parse_args([entry.flags[0], value]) == parse_args([])


def test_no_ops_aliases_and_the_recompute_switch() -> None:
    base = parse_args([])
    for c in COMPAT_NO_OPS:
        for flag in c.flags:
            argv = [flag, c.choices[0]] if c.choices else [flag, "3"] if c.takes_value else [flag]
            assert parse_args(argv) == base, flag
    cfg = parse_args(
        ["--encoder-num-layers", "6", "--encoder-seq-length", "96", "--recompute-activations"]
    )
    assert (cfg.model.num_layers, cfg.model.seq_length) == (6, 96)
    assert cfg.model.recompute_granularity == "selective"
    assert parse_args(["--exit-on-missing-checkpoint"]).checkpoint.exit_on_missing_checkpoint
    assert parse_args(["--deepscale_config", "x.json"]).training.deepspeed_config == "x.json"
    # Megatron-DeepSpeed's pretrain_gpt.py defaults --tokenizer-type to GPT2BPETokenizer (their GPT scripts omit it).
    gpt2 = ["--vocab-file", "v.json", "--merge-file", "m.txt"]
    assert parse_args(gpt2).data.tokenizer_type == "GPT2BPETokenizer"
    explicit = parse_args([*gpt2, "--tokenizer-type", "HFTokenizer"])
    assert explicit.data.tokenizer_type == "HFTokenizer"
    assert (
        parse_args(["--vocab-size", "64"]).data.tokenizer_type is None
    )  # NullTokenizer, as before


def _pretrain(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *argv],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--kd", "--load-teacher", "/ckpt/teacher"],
        ["--num-experts", "64", "--use-tutel"],  # MoE yes, Tutel no
        ["--ds-sequence-parallel-size", "4", "--ds-sequence-parallel-fpdt"],  # Ulysses yes, FPDT no
        ["--enable-zbh1-pipeline"],
        ["--inference"],
    ],
    ids=lambda a: a[-1] if len(a) == 1 else a[0],
)
def test_refused_flag_through_pretrain_gpt(argv: list[str]) -> None:
    r = _pretrain("--num-layers", "2", *argv, "--mock-data")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --") and " is refused" in lines[0], (
        r.stderr
    )
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_exit_on_missing_checkpoint_stops_the_run(tmp_path: Path) -> None:
    tiny = [
        "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "1", "--train-iters", "2", "--mock-data",
        "--vocab-size", "64", "--eval-iters", "0", "--log-level", "WARNING",
    ]  # fmt: skip
    r = _pretrain(*tiny, "--load", str(tmp_path), "--exit-on-missing-checkpoint", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--exit-on-missing-checkpoint is set" in r.stderr and "Traceback" not in r.stderr
