"""Evaluate a Trident checkpoint with lm-evaluation-harness tasks, at any TP x PP layout, offline.

    python tools/eval_harness.py --load ckpt/ --tasks trident_lastword trident_choice \\
        --include-path examples/eval_tasks --limit 100 --output-path results.json
    torchrun --nproc-per-node 4 tools/eval_harness.py --load ckpt/ --tensor-model-parallel-size 2 \\
        --pipeline-model-parallel-size 2 --tasks trident_choice --include-path examples/eval_tasks

Launched like tools/generate_text.py (one process, or TP x PP processes under torchrun / deepspeed / srun): every
rank runs the same tasks, global rank 0 prints the table and writes ``--output-path``. Tasks come from
``--include-path`` (YAML files; their data from local files, ``dataset_path: json``), never from the network
(``HF_DATASETS_OFFLINE=1``). Megatron-DeepSpeed's ``tasks/eval_harness`` spellings are accepted too
(``--task_list a,b``, ``--num_fewshot``, ``--results_path``). Exit codes: 0 ok, 2 bad input (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from tools._textgen_common import add_load_args, build_generator

EXIT_INPUT_ERROR = 2
ERROR_GRACE_SECONDS = 2.0
"""How long ranks other than 0 wait before exiting on a user-input error (rank 0 prints it)."""


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_load_args(p)
    ev = p.add_argument_group("evaluation")
    ev.add_argument(
        "--tasks",
        "--task_list",
        dest="tasks",
        nargs="+",
        required=True,
        help="task names (space- or comma-separated)",
    )
    ev.add_argument("--include-path", default=None, help="directory of task YAML files")
    ev.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    ev.add_argument("--num-fewshot", "--num_fewshot", dest="num_fewshot", type=int, default=None)
    ev.add_argument(
        "--batch-size", type=int, default=8, help="requests scored or generated together"
    )
    ev.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="context in tokens (default: the model's --max-position-embeddings, else --seq-length)",
    )
    ev.add_argument(
        "--output-path", "--results_path", dest="output_path", default=None, help="results JSON"
    )
    ev.add_argument("--seed", type=int, default=1234, help="seeds sampled generations")
    a = p.parse_args(argv)
    a.tasks = [t for item in a.tasks for t in item.split(",") if t]
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from megatron.evaluation import TridentLM, evaluate_tasks, task_manager
    from megatron.evaluation.report import check_output_path, results_table, write_results
    from megatron.text_generation.distributed import destroy_inference_distributed

    try:
        _check_counts(a)
        check_output_path(a.output_path)
        task_manager(a.tasks, a.include_path)  # unknown names fail before the model loads
        gen = build_generator(a)
        lm = TridentLM(
            gen.engine, gen.tokenizer, batch_size=a.batch_size, max_length=a.max_length, seed=a.seed
        )
        results = evaluate_tasks(
            lm, a.tasks, include_path=a.include_path, limit=a.limit, num_fewshot=a.num_fewshot
        )
        if gen.is_server_rank:
            print(results_table(results))
            if a.output_path:
                write_results(a.output_path, results, _config(a, gen))
    except (ValueError, FileNotFoundError) as e:
        if _is_rank_zero():
            print(f"error: {e}", file=sys.stderr)
        else:
            time.sleep(
                ERROR_GRACE_SECONDS
            )  # let rank 0 write the one error line before the launcher stops
        return EXIT_INPUT_ERROR
    finally:
        destroy_inference_distributed()
    return 0


def _check_counts(a: argparse.Namespace) -> None:
    """--batch-size, --limit, --num-fewshot and --max-length, before anything is loaded."""
    for flag, value, low in (
        ("--batch-size", a.batch_size, 1),
        ("--limit", a.limit, 1),
        ("--num-fewshot", a.num_fewshot, 0),
        ("--max-length", a.max_length, 2),
    ):
        if value is not None and value < low:
            raise ValueError(f"{flag} ({value}) must be >= {low}.")


def _config(a: argparse.Namespace, gen: object) -> dict[str, object]:
    engine = gen.engine  # type: ignore[attr-defined]
    return {
        "load": a.load,
        "tasks": a.tasks,
        "include_path": a.include_path,
        "limit": a.limit,
        "num_fewshot": a.num_fewshot,
        "batch_size": a.batch_size,
        "tensor_model_parallel_size": engine.stage.parallel.tp_size,
        "pipeline_model_parallel_size": engine.pp_size,
    }


def _is_rank_zero() -> bool:
    """Global rank 0 (before the process group exists: the launcher's RANK), which alone prints errors."""
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0") == "0"


if __name__ == "__main__":
    sys.exit(main())
