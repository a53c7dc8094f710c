"""Judging a trained model: perplexity on a dataset and multiple-choice accuracy by
log-likelihood on local task files (lm-evaluation-harness's formats and rules)."""
