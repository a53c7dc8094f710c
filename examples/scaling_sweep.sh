#!/usr/bin/env bash
# A small scaling-law sweep on this machine: model sizes x token budgets trained on the
# built-in corpus (one process each, a cosine schedule over each run's own length), then
# tools/fit_scaling.py fits L(C) and L(N, D) to the runs and draws loss against compute.
# A toy corpus and millions of parameters: the exponents describe this sweep, not language
# models at large (docs/research.md compares them with Chinchilla's).
#
#   SIZES    hidden:layers of each model (default "32:1 64:2 128:2")
#   ITERS    training iterations of each budget (default "100 200 400"), batch 8 x 256 tokens
#   SWEEP    output folder (default data/scaling_sweep; each run in SWEEP/h<hidden>_l<layers>_i<iters>)
#   DATA     the quickstart's dataset and tokenizer (made first when missing)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/quickstart}
SWEEP=${SWEEP:-data/scaling_sweep}
SIZES=${SIZES:-"32:1 64:2 128:2"}
ITERS=${ITERS:-"100 200 400"}
if [ ! -f "$DATA/stdlib_text_document.idx" ]; then
    DATA=$DATA bash examples/prepare_data.sh
fi
mkdir -p "$SWEEP"
for size in $SIZES; do
    hidden=${size%%:*}
    layers=${size##*:}
    for iters in $ITERS; do
        run="$SWEEP/h${hidden}_l${layers}_i${iters}"
        if [ -f "$run/metrics.run.json" ] && grep -q '"split": "test"' "$run/metrics.jsonl" 2>/dev/null; then
            echo "== $run: done before"
            continue
        fi
        rm -rf "$run"
        echo "== $run: hidden $hidden, $layers layers, $iters iterations"
        NPROC_PER_NODE=1 DATA=$DATA bash examples/pretrain_gpt.sh \
            --num-layers "$layers" --hidden-size "$hidden" --num-attention-heads 4 \
            --micro-batch-size 8 --global-batch-size 8 --train-iters "$iters" \
            --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters 10 \
            --hidden-dropout 0.0 --attention-dropout 0.0 --weight-decay 0.1 --clip-grad 1.0 \
            --log-interval 5 --eval-interval "$iters" --eval-iters 4 \
            --log-jsonl "$run/metrics.jsonl" > "$run.log" 2>&1 || {
                echo "run failed: see $run.log" >&2
                exit 1
            }
        grep "^valid at iteration" "$run.log" | tail -1 || true
    done
done
python tools/fit_scaling.py --runs "$SWEEP" --output "$SWEEP/scaling.png" \
    --json "$SWEEP/fit.json" "$@"
