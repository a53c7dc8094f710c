#!/usr/bin/env bash
# The quickstart's model trained with 3 seeds (one process each), then one dashboard where the
# runs that differ only in --seed are drawn as mean +- standard deviation and their final
# losses printed as such (tools/plot_metrics.py). Arguments are added to every run's flags.
#
#   SEEDS    the seeds (default "1234 1235 1236")
#   ITERS    training iterations of each run (default 100)
#   SWEEP    output folder (default data/seed_sweep; each run in SWEEP/seed<seed>)
#   DATA     the quickstart's dataset and tokenizer (made first when missing)
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/quickstart}
SWEEP=${SWEEP:-data/seed_sweep}
SEEDS=${SEEDS:-"1234 1235 1236"}
ITERS=${ITERS:-100}
if [ ! -f "$DATA/stdlib_text_document.idx" ]; then
    DATA=$DATA bash examples/prepare_data.sh
fi
mkdir -p "$SWEEP"
logs=()
for seed in $SEEDS; do
    run="$SWEEP/seed$seed"
    rm -rf "$run"
    echo "== $run"
    NPROC_PER_NODE=1 DATA=$DATA bash examples/pretrain_gpt.sh \
        --hidden-dropout 0.0 --attention-dropout 0.0 --lr-warmup-iters 20 --min-lr 1e-4 \
        --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --seed "$seed" \
        --train-iters "$ITERS" --eval-interval 25 --log-interval 5 \
        --log-jsonl "$run/metrics.jsonl" "$@" > "$run.log" 2>&1 || {
            echo "run failed: see $run.log" >&2
            exit 1
        }
    logs+=("$run/metrics.jsonl")
done
python tools/plot_metrics.py --log-jsonl "${logs[@]}" --output "$SWEEP/seeds.png" \
    --title "quickstart model, $(echo "$SEEDS" | wc -w) seeds: mean +- std"
