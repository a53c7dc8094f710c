"""lm-evaluation-harness's command line with this engine's checkpoints as `--model tripod`
(lm_eval is an optional dependency: `pip install lm_eval==0.4.13`).

  python tools/lm_eval_tripod.py --model tripod --model_args load=SAVE_DIR \\
      --tasks hellaswag --num_fewshot 0 [--include_path DIR_OF_TASK_YAMLS]

--model_args takes load= (our checkpoint root, saved under any layout, or a Hugging Face
folder), iteration= and max_length=. Every other flag is lm_eval's own.
"""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print(
            "error: lm_eval is not installed; pip install lm_eval==0.4.13 (an optional "
            "dependency) to use the harness",
            file=sys.stderr,
        )
        return 2
    import engine.eval.lm_eval_adapter  # noqa: F401 - registers the model as "tripod"

    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
