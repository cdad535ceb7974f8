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
6    ``EXIT_NON_FINITE``             a NaN/Inf loss or grad norm (--check-for-nan-in-loss-and-grad, on by default):
                                     nothing saved, ``latest`` stays at the last good checkpoint
7    ``EXIT_HANG``                   a training step (or checkpoint save) ran past --hang-timeout-minutes /
                                     --hang-timeout-factor: this rank's stacks are in its log (``watchdog.py``);
                                     nothing saved
8    ``EXIT_PEER_LOST``              another rank died (SIGKILL, OOM killer, crash) and a collective failed: one line
                                     naming the rank where it is knowable (``peers.py``); nothing saved
130  ``EXIT_INTERRUPTED``            Ctrl-C (SIGINT): during training, the same clean stop as SIGTERM (saved if
                                     --save); before it, one line and no traceback
==== =============================== ===============================================================================

A job scheduler that re-submits on 3, 4 or 5 resumes from ``--load`` where the run stopped; 6 needs a person (lower
--lr, resume from an earlier checkpoint, ...): resubmitting would stop at the same iteration again. On 7 read the
stacks first (a rank not in the same collective as the others, a dead node, a network fault); resubmitting resumes
from the last checkpoint. On 8 look at the rank that died (its log, the launcher's report, the kernel log for the
OOM killer); resubmitting resumes from the last checkpoint.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CONFIG_ERROR = 2
EXIT_INTERVAL = 3
EXIT_DURATION = 4
EXIT_SIGNAL = 5
EXIT_NON_FINITE = 6
EXIT_HANG = 7
EXIT_PEER_LOST = 8
EXIT_INTERRUPTED = 130


class ConfigError(ValueError):
    """Bad user input found after the process groups exist (a checkpoint's LR schedule against the flags, a --save
    another run holds): identical on every rank, so every rank raises it together; ``pretrain_gpt.py`` prints
    its one line and exits with :data:`EXIT_CONFIG_ERROR`."""


EXIT_REASONS: dict[int, str] = {
    EXIT_OK: "finished",
    EXIT_CONFIG_ERROR: "configuration error",
    EXIT_INTERVAL: "--exit-interval reached",
    EXIT_DURATION: "--exit-duration-in-mins reached",
    EXIT_SIGNAL: "SIGTERM received",
    EXIT_NON_FINITE: "non-finite loss or grad norm",
    EXIT_HANG: "hang watchdog fired (stacks in the log)",
    EXIT_PEER_LOST: "another rank died",
    EXIT_INTERRUPTED: "interrupted (SIGINT)",
}
