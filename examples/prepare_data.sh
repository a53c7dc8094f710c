#!/usr/bin/env bash
# The quickstart's data: the built-in corpus (Python standard-library sources, no download),
# a SentencePiece tokenizer trained on it, and the corpus preprocessed into an indexed dataset
# ($DATA/stdlib_text_document.{bin,idx}, default DATA=data/quickstart; the corpus itself under
# CORPUS, default data/corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/quickstart}
CORPUS=${CORPUS:-data/corpus}
mkdir -p "$DATA"

echo "== built-in corpus"
python tools/make_corpus.py --output-dir "$CORPUS"

echo "== tokenizer"
python tools/train_tokenizer.py --input "$CORPUS/stdlib.jsonl" \
    --model-prefix "$DATA/tokenizer" --vocab-size 8000

echo "== preprocess to an indexed dataset"
python tools/preprocess_data.py --input "$CORPUS/stdlib.parquet" \
    --output-prefix "$DATA/stdlib" --tokenizer-model "$DATA/tokenizer.model" \
    --append-eod --workers 2
