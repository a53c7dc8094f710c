#!/usr/bin/env bash
# The main job end to end on the built-in corpus (Python standard-library sources, no
# download): corpus -> tokenizer -> preprocessed dataset -> packed samples decoded back.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/quickstart}
mkdir -p "$DATA"

echo "== 1/4 built-in corpus"
python tools/make_corpus.py --output-dir data/corpus

echo "== 2/4 tokenizer"
python tools/train_tokenizer.py --input data/corpus/stdlib.jsonl \
    --model-prefix "$DATA/tokenizer" --vocab-size 8000

echo "== 3/4 preprocess to indexed dataset"
python tools/preprocess_data.py --input data/corpus/stdlib.parquet \
    --output-prefix "$DATA/stdlib" --tokenizer-model "$DATA/tokenizer.model" \
    --append-eod --workers 2

echo "== 4/4 first packed samples"
python tools/show_samples.py --data-path "$DATA/stdlib_text_document" \
    --tokenizer-model "$DATA/tokenizer.model" --seq-length 256 --num-samples 2
