"""One task of a distributed preprocessing run, as a Slurm array task runs it:

python -m engine.data.prepare.task_main --output data/web.parts --stage tokenize --index 3
"""

from __future__ import annotations

from engine.cli import run_main
from engine.data.prepare.distributed import run_task
from engine.execution.job import task_main

if __name__ == "__main__":
    run_main(lambda argv: task_main(run_task, argv))
