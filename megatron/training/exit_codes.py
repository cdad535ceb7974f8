"""Process exit codes of ``pretrain_gpt.py`` (distinct, so job scripts can tell why a run stopped).

==== =============================== ===============================================================================
code name                            meaning
==== =============================== ===============================================================================
0    ``EXIT_OK``                     training reached --train-iters / --train-samples (or there was nothing to do)
1    (Python's default)              an unexpected exception (a bug or an environment failure: traceback printed)
2    ``EXIT_CONFIG_ERROR``           bad flags, a contradicting --deepspeed_config, a missing file: one ``error: ...``
                                     line on stderr, no traceback; raised before any process group exists
3    ``EXIT_INTERVAL``               stopped by --exit-interval (iteration % N == 0, before the last); saved if --save
4    ``EXIT_DURATION``               stopped by --exit-duration-in-mins (max elapsed time over ranks); saved if --save
5    ``EXIT_SIGNAL``                 stopped by SIGTERM (exit signal handler); saved if --save
==== =============================== ===============================================================================

A job scheduler that re-submits on 3, 4 or 5 resumes from ``--load`` where the run stopped.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CONFIG_ERROR = 2
EXIT_INTERVAL = 3
EXIT_DURATION = 4
EXIT_SIGNAL = 5

EXIT_REASONS: dict[int, str] = {
    EXIT_OK: "finished",
    EXIT_CONFIG_ERROR: "configuration error",
    EXIT_INTERVAL: "--exit-interval reached",
    EXIT_DURATION: "--exit-duration-in-mins reached",
    EXIT_SIGNAL: "SIGTERM received",
}
