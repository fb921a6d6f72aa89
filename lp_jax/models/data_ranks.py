"""Attention per data rank: each rank writes and reads only its own share of the KV pool.

Under data-parallel attention (docs/data_parallel.md) a step's rows are laid out rank
by rank: a call of bucket N has R N rows, rank r's at [r N, (r + 1) N), and its batch
metadata is *ranked* (`metadata.build_ranked_metadata`): positions_T and slots_T are
the flat R N rows, and the per-sequence arrays gain a leading rank axis
(query_start [R, B + 1], seq_lens [R, B], page_table [R, B, C], num_seqs [R]), with
page ids and slots local to the rank's pages. The rank-major pool (kv_cache.py) is
split over "data" so that rank r's device holds exactly the rows of its pages, and a
rank-local page id p of layer i sits at row i P_r + p of that shard: the layer-major
layout of a one-rank pool of P_r pages.

`per_rank` runs a model's KV write and paged attention inside a `jax.shard_map` that is
manual over "data" only: the rows, the metadata and the pool enter split over "data",
nothing is gathered, each rank sees a one-rank model (cfg.kv_ranks = 1) on its rows and
its pool shard, and the other mesh axes ("tensor": the heads) stay under GSPMD as they
are outside. So each rank runs the single-rank attention code, kernels included: a
Pallas kernel's shard_map over the heads nests inside this one, on the context's mesh
(`sharded_kernels.kernel_mesh`), and reads the rank's metadata view, the forms it reads
without data ranks. Without that, XLA partitions a global write and gather of the split
pool and combines the gathered pages by an all-reduce over "data" every layer (and on a
pod copies the pool's shard around them).
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from lp_jax.config import ModelConfig
from lp_jax.models.metadata import AttentionMetadata


def is_ranked(meta: AttentionMetadata) -> bool:
    """Whether meta is laid out per data rank (a leading rank axis on num_seqs)."""
    return jax.numpy.ndim(meta.num_seqs) == 1


def _rank_view(meta: AttentionMetadata) -> AttentionMetadata:
    """One rank's shard of ranked metadata as ordinary metadata (the rank axis dropped)."""
    return dataclasses.replace(meta, query_start_B1=meta.query_start_B1[0],
                               seq_lens_B=meta.seq_lens_B[0],
                               page_table_BC=meta.page_table_BC[0], num_seqs=meta.num_seqs[0])


def per_rank(cfg: ModelConfig, body, kv_pages, meta: AttentionMetadata, *rows):
    """body(cfg, kv_pages, meta, *rows) -> (out, kv_pages), run on each data rank.

    With ranked metadata, body runs once per rank inside a shard_map over "data": it
    gets a one-rank config, the rank's pool shard, its metadata (local page ids) and its
    rows of each of `rows` (arrays of R N rows), and returns rows of its own and the
    updated shard. Otherwise body runs once on everything, as on one rank. Whatever
    body closes over (weights, the layer index) stays as it is, replicated over "data"."""
    if not is_ranked(meta):
        return body(cfg, kv_pages, meta, *rows)
    ranks = meta.num_seqs.shape[0]
    mesh = jax.typeof(kv_pages).sharding.mesh
    if dict(mesh.shape).get("data", 1) != ranks or cfg.kv_ranks != ranks:
        raise ValueError(f"metadata of {ranks} data ranks needs a pool of as many ranks "
                         f"on the mesh's data axis (kv_ranks {cfg.kv_ranks}, mesh "
                         f"{dict(mesh.shape)})")
    one = cfg.replace(kv_ranks=1)

    def local(kv, meta, *rows):
        return body(one, kv, _rank_view(meta), *rows)

    split = P("data")
    return jax.shard_map(local, mesh=mesh, in_specs=(split, split, *(split for _ in rows)),
                         out_specs=(split, split), axis_names={"data"},
                         check_vma=False)(kv_pages, meta, *rows)
