"""Expert parallelism (a mixture of experts' experts spread over ranks): its process groups
(groups.py)."""
