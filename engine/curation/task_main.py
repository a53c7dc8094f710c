"""One task of a curation run, as a Slurm array task runs it:

python -m engine.curation.task_main --output curated/ --stage first --index 3
"""

from __future__ import annotations

from engine.cli import run_main
from engine.curation.tasks import run_task
from engine.execution.job import task_main

if __name__ == "__main__":
    run_main(lambda argv: task_main(run_task, argv))
