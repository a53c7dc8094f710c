"""Corpus-wide removal of duplicate documents, as tasks that each do a share of the work:

    exact (task r of R)      documents whose normalised text's hash falls in partition r
                             (hash mod R) and was seen earlier in the corpus -> exact-r.npy
    bands (task b*R + r)     MinHash band b of the documents exact left, those whose band key
                             falls in partition r: documents equal in the band and next to
                             each other in corpus order are candidates, joined when their
                             signatures agree enough -> edges-b-r.npy (pairs of numbers)
    clusters (one task)      the connected components of every edge; each keeps its first
                             document, the others are near duplicates -> near.npy

A partition holds 1/R of the hashes or band keys (the first step hashed each band once); the
clusters task holds the distinct pairs found (a pair found in several bands once). Components
do not depend on the order edges come in, so the result is engine/curation/minhash.py's
duplicate_of on the whole corpus, whatever R is (tested).
"""

from __future__ import annotations

import os

import numpy as np

from engine.curation.atomic import save_npy
from engine.curation.dedup.layout import Part, SortedIds, save_ids

DEDUP_FOLDER = "dedup"


def exact_path(work: str, r: int) -> str:
    return os.path.join(work, DEDUP_FOLDER, f"exact-{r:05d}.npy")


def edges_path(work: str, band: int, r: int) -> str:
    return os.path.join(work, DEDUP_FOLDER, f"edges-{band:03d}-{r:05d}.npy")


def near_path(work: str) -> str:
    return os.path.join(work, DEDUP_FOLDER, "near.npy")


def exact_task(work: str, parts: list[Part], r: int, partitions: int) -> None:
    hashes, ids = [], []
    for part in parts:
        if not part.documents:
            continue
        with np.load(os.path.join(part.folder, "hashes.npz")) as f:
            document = f["document"]
        mine = np.flatnonzero(document % np.uint64(partitions) == r)
        hashes.append(document[mine])
        ids.append(mine + part.first_document)
    hashes = np.concatenate(hashes or [np.empty(0, np.uint64)])
    ids = np.concatenate(ids or [np.empty(0, np.int64)])
    _, first = np.unique(hashes, return_index=True)  # the first of each, in corpus order
    repeat = np.ones(len(ids), bool)
    repeat[first] = False
    save_ids(exact_path(work, r), ids[repeat])


def _alive(part: Part, removed: SortedIds | None) -> np.ndarray:
    """The part's survivors (row numbers) that no earlier stage removed."""
    rows = np.arange(part.documents)
    if removed is None:
        return rows
    start = part.first_document
    return np.setdiff1d(rows, removed.within(start, start + part.documents))


def band_task(work: str, parts: list[Part], band: int, r: int, partitions: int, params,
              exact_files: list[str]) -> None:  # fmt: skip
    removed = SortedIds(exact_files) if exact_files else None
    keys, ids = [], []
    for part in parts:
        if not part.documents:
            continue
        alive = _alive(part, removed)  # the band's keys, hashed once by the first step
        keys_of_part = np.load(os.path.join(part.folder, "band_keys.npy"), mmap_mode="r")
        key = np.asarray(keys_of_part[alive, band])
        mine = key % np.uint64(partitions) == r
        keys.append(key[mine])
        ids.append(alive[mine] + part.first_document)
    keys = np.concatenate(keys or [np.empty(0, np.uint64)])
    ids = np.concatenate(ids or [np.empty(0, np.int64)])
    order = np.argsort(keys, kind="stable")  # ids ascend within a key
    same = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    pairs = np.stack([ids[order[same]], ids[order[same + 1]]], axis=1)
    agree = params.plan().agree
    if agree and len(pairs):
        signature = _SignatureReader(parts)
        kept = [np.count_nonzero(signature(i) == signature(j)) >= agree for i, j in pairs]
        pairs = pairs[np.array(kept, bool)]
    path = edges_path(work, band, r)
    save_npy(path, np.unique(pairs.reshape(-1, 2).astype(np.int64), axis=0))


class _SignatureReader:
    """A document's signature by its global number (each part's file mapped once)."""

    def __init__(self, parts: list[Part]):
        self.parts = [p for p in parts if p.documents]
        self.starts = np.array([p.first_document for p in self.parts])
        self.maps: dict[int, np.ndarray] = {}

    def __call__(self, number: int) -> np.ndarray:
        k = int(np.searchsorted(self.starts, number, side="right")) - 1
        if k not in self.maps:
            path = os.path.join(self.parts[k].folder, "signatures.npy")
            self.maps[k] = np.load(path, mmap_mode="r")
        return np.asarray(self.maps[k][number - self.parts[k].first_document])


def clusters_task(work: str, edge_files: list[str]) -> None:
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    edges = np.empty((0, 2), np.int64)
    for path in edge_files:  # a pair found in several bands is held once
        edges = np.unique(np.concatenate([edges, np.load(path)]), axis=0)
    nodes, local = np.unique(edges, return_inverse=True)
    local = local.reshape(-1, 2)
    graph = coo_matrix(
        (np.ones(len(local), bool), (local[:, 0], local[:, 1])), shape=(len(nodes),) * 2
    )
    _, component = connected_components(graph, directed=False)
    first = np.full(component.max() + 1 if len(nodes) else 0, np.iinfo(np.int64).max)
    np.minimum.at(first, component, nodes)  # nodes ascend: the component's first document
    save_ids(near_path(work), nodes[first[component] != nodes])
