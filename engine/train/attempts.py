"""Attempts of a job that torchrun restarts (`--max-restarts N`): the launcher says what ended
an attempt, and the next attempt's ranks say which attempt they are and why it began.

torchrun's elastic agent logs a failed attempt in two records: the first failed worker
("failed (exitcode: C) local_rank: R ...", from its process context) and the decision to restart
("Worker group FAILED. K/N attempts left; will restart worker group"). `AttemptReporter`
listens to those two records, prints one line for people, and leaves the description in this
process's environment (PREVIOUS_ATTEMPT_VARIABLE), which the agent copies into the ranks it
starts next.
"""

from __future__ import annotations

import logging
import os
import signal
import sys

from parallel.hang_watchdog import HANG_EXIT_CODE

PREVIOUS_ATTEMPT_VARIABLE = "TRIPOD_PREVIOUS_ATTEMPT_ENDED"
AGENT_LOGGERS = (
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.elastic.multiprocessing.api",
)


def exit_description(exitcode: int | None) -> str:
    """'exited with code 1' or 'was killed by SIGKILL' (a negative code is a signal)."""
    if exitcode == HANG_EXIT_CODE:
        return "stopped on a hang (exit code 75, --hang-timeout-seconds)"
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class AttemptReporter(logging.Handler):
    """Turns the agent's records of a failed attempt into one line on `stream`."""

    def __init__(self, node: str | None = None, stream=None):
        """`node`: this launcher's node, named in its lines when the job has several."""
        super().__init__(logging.INFO)
        self.node = node
        self.stream = stream or sys.stderr
        self.first_failure: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._read(record)
        except Exception:  # noqa: BLE001 - a report must never stop the agent
            self.handleError(record)

    def _read(self, record: logging.LogRecord) -> None:
        if not isinstance(record.msg, str):
            return
        if record.msg.startswith("failed (exitcode"):
            exitcode, local_rank = record.args[0], record.args[1]
            where = f"local rank {local_rank}" + (f" of node {self.node}" if self.node else "")
            self.first_failure = f"{where} {exit_description(exitcode)}"
        elif "attempts left" in record.msg:
            left, restarts = int(record.args[2]), int(record.args[3])
            ended = restarts - left + 1  # attempts are counted from 1
            what = self.first_failure or "a rank failed"
            print(
                f"attempt {ended} ended: {what}; restarting from the newest checkpoint "
                f"(restart {ended} of {restarts})",
                file=self.stream,
                flush=True,
            )
            os.environ[PREVIOUS_ATTEMPT_VARIABLE] = f"attempt {ended} ended: {what}"
            self.first_failure = None


def listen_to_the_agent(reporter: AttemptReporter) -> None:
    """Route the agent's records to `reporter` alone (its other records are noise here: the
    ranks print their own errors and the launcher summarises the final failure)."""
    for name in AGENT_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.propagate = False
        logger.handlers[:] = [reporter]


def attempt_line() -> str | None:
    """What rank 0 logs at start in an attempt after the first: 'attempt 2 of 3 (attempt 1
    ended: local rank 1 was killed by SIGKILL)'; None in a first attempt or without torchrun."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0:
        return None
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", str(attempt)))
    why = os.environ.get(PREVIOUS_ATTEMPT_VARIABLE, f"attempt {attempt} ended")
    return f"attempt {attempt + 1} of {restarts + 1} ({why})"
