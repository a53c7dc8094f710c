"""A heartbeat file per node (--heartbeat-dir): what a scheduler's health check reads to see
that a run is alive and moving, without parsing its log.

The first rank of each node rewrites `<dir>/heartbeat_<host>.json` (atomically: a reader never
sees half a file) at most once every `min_interval` seconds while training, and whenever the
run's state changes:

    {"host": ..., "rank": 0, "pid": ..., "state": "training", "iteration": 120,
     "consumed_samples": 1920, "tokens": 491520, "time": 1796300000.0}

`state` is training, then finished or stopped. A file whose time stops moving while its state
is training belongs to a run that hangs or died; compare it with the hang watchdog's timeout.
"""

from __future__ import annotations

import json
import os
import socket
import time


class Heartbeat:
    def __init__(self, folder: str, rank: int, min_interval: float = 1.0):
        self.path = os.path.join(folder, f"heartbeat_{socket.gethostname()}.json")
        self.rank, self.min_interval = rank, min_interval
        self.last_write = float("-inf")
        self.state = None
        os.makedirs(folder, exist_ok=True)

    def beat(self, iteration: int, consumed_samples: int, tokens: int, state="training") -> None:
        now = time.time()
        if state == self.state and now - self.last_write < self.min_interval:
            return
        record = {
            "host": socket.gethostname(),
            "rank": self.rank,
            "pid": os.getpid(),
            "state": state,
            "iteration": iteration,
            "consumed_samples": consumed_samples,
            "tokens": tokens,
            "time": now,
        }
        tmp = f"{self.path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)
        self.last_write, self.state = now, state
