"""Prompt batches through Ray Data: parallel read and tokenisation, a seeded order per
epoch, batches streamed to the controller (`data.loader=ray`).

The parquet files (or in-memory rows) are read and tokenised by Ray Data tasks across
the cluster, once; rows that cannot be used are set aside with their reason, as with
the default loader. Each epoch orders the rows by a key hashed from (seed, epoch,
prompt id) and sorts on it: a shuffle that gives the same order on any cluster shape
and block layout (Ray's `random_shuffle(seed)` depends on both), so a run is
deterministic for a seed and resumes at a checkpoint's data position (batch `start`
of an epoch) exactly. Batches are pulled with prefetching while the step runs. `data.dataloader_num_workers`
sets the number of blocks, i.e. of parallel read-and-tokenise tasks.

A prompt's id is `r` + a hash of its row (its content is its identity: the same
prompt has the same id in every run, whichever file order or block it came in).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any

from rayrl.batch import Batch
from rayrl.data.dataset import PromptDataset
from rayrl.data.errors import DataError

# What Ray Data's tasks need outside the run's pools: a local Ray of a CPU-only run
# starts with this many logical CPUs more (`rayrl.trainer.resources.local_cpu_count`)
DATA_CPUS = 1.0


def _row_id(row: dict[str, Any]) -> str:
    text = json.dumps(row, sort_keys=True, default=str)
    return "r" + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _order_key(seed: int, epoch: int, uid: str) -> int:
    digest = hashlib.blake2b(f"{seed}:{epoch}:{uid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # fits int64


def _tokenise(table: Any, tokenizer: Any, settings: dict[str, Any]) -> Any:
    """A Ray Data task: verl rows -> uid, token ids, the row as JSON, `ok` (1: usable)
    and `problem` (why a row was set aside)."""
    import pyarrow as pa

    rows = table.to_pylist()
    ds = PromptDataset(rows, tokenizer, **settings)
    problems = {r.index: r.reason for r in ds.rejected}
    ids = dict(zip(ds.positions, ds.prompt_ids, strict=True))
    return pa.table(
        {
            "uid": [_row_id(r) for r in rows],
            "prompt_ids": [ids.get(i, []) for i in range(len(rows))],
            "row": [json.dumps(r, default=str) for r in rows],
            "ok": [int(i in ids) for i in range(len(rows))],
            "problem": [problems.get(i, "") for i in range(len(rows))],
        }
    )


def _usable_in_order(table: Any, seed: int, epoch: int) -> Any:
    """A Ray Data task: the usable rows with their sort key for (seed, epoch)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = table.filter(pc.equal(table["ok"], 1))
    keys = [_order_key(seed, epoch, u) for u in table.column("uid").to_pylist()]
    return table.append_column("order", pa.array(keys, pa.int64()))


class RayPromptLoader:
    """Training prompts read, tokenised and ordered by Ray Data (same API as PromptDataset)."""

    def __init__(
        self,
        *,
        files: Sequence[str] | None = None,
        rows: list[dict[str, Any]] | None = None,
        tokenizer: Any,
        max_prompt_length: int,
        truncation: str = "error",
        filter_overlong: bool = True,
        prompt_key: str = "prompt",
        prefetch_batches: int = 2,
        num_blocks: int = 0,
        tools: Sequence[dict[str, Any]] | None = None,
        default_agent: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        image_key: str = "images",
        video_key: str = "videos",
    ) -> None:
        import pyarrow.compute as pc
        import ray.data

        if (files is None) == (rows is None):
            raise ValueError("RayPromptLoader needs either parquet files or rows")
        self.tokenizer, self.prefetch = tokenizer, prefetch_batches
        settings = {
            "max_prompt_length": max_prompt_length,
            "truncation": truncation,
            "filter_overlong": filter_overlong,
            "prompt_key": prompt_key,
            "tools": list(tools) if tools else None,
            "default_agent": default_agent,
            "chat_template_kwargs": dict(chat_template_kwargs or {}),
            "image_key": image_key,  # rows with images are set aside: no image processor here
            "video_key": video_key,
        }
        self.default_agent = default_agent
        ctx = ray.data.DataContext.get_current()
        # Ray 2.60's V2 parquet reader spends far longer in its file-listing task per read
        # than the V1 reader takes for the same files (docs/benchmarks.md).
        ctx.use_datasource_v2 = False
        ctx.enable_progress_bars = False
        ctx.execution_options.preserve_order = True  # blocks in sorted order, always
        # Blocks = parallel tokenising tasks (`data.dataloader_num_workers`; 0: one per CPU
        # of the cluster). Few of them: the per-epoch sort is all-to-all, its cost grows
        # with the square of the block count; the order does not depend on the blocks.
        blocks = num_blocks or max(2, int(ray.cluster_resources().get("CPU", 2)))
        source = (
            ray.data.read_parquet(list(files), override_num_blocks=blocks)
            if files
            else ray.data.from_items(rows, override_num_blocks=blocks)
        )
        self.base = source.map_batches(
            _tokenise, fn_args=(tokenizer, settings), batch_format="pyarrow"
        ).materialize()
        total = self.base.count()
        ok = self.base.select_columns(["ok"]).iter_batches(batch_format="pyarrow", batch_size=None)
        self._len = sum(int(pc.sum(t["ok"]).as_py() or 0) for t in ok)  # a scan, no shuffle
        self.rejected = total - self._len

    def __len__(self) -> int:
        return self._len

    def epoch(self, epoch: int, seed: int, shuffle: bool = True) -> Any:
        """The epoch's rows in their seeded order, as a Ray Dataset."""
        return self.base.map_batches(
            _usable_in_order, fn_args=(seed, epoch if shuffle else -1), batch_format="pyarrow"
        ).sort("order")

    def batches(
        self, batch_size: int, *, epoch: int, seed: int, shuffle: bool = True, start: int = 0
    ) -> Iterator[Batch]:
        """Whole batches of an epoch from batch number `start` (the data position)."""
        require_free_cpu()
        stream = self.epoch(epoch, seed, shuffle).iter_batches(
            batch_size=batch_size,
            batch_format="pyarrow",
            drop_last=True,
            prefetch_batches=self.prefetch,
        )
        for index, table in enumerate(stream):
            if index >= start:
                yield self.collate_table(table)

    def collate_table(self, table: Any) -> Batch:
        rows = [json.loads(r) for r in table.column("row").to_pylist()]
        prompt_ids = table.column("prompt_ids").to_pylist()
        uids = table.column("uid").to_pylist()
        ds = PromptDataset.tokenized(rows, prompt_ids, uids, self.tokenizer)
        ds.default_agent = self.default_agent
        return ds.collate(range(len(rows)))


def require_free_cpu(wait_s: float = 10.0) -> None:
    """Raise DataError when the cluster has no CPU outside placement groups (the run's
    pools hold them all) for `wait_s`: Ray Data's ordering tasks would wait for one
    forever, and the run would hang with no word."""
    import time

    import ray

    deadline = time.monotonic() + wait_s
    while ray.available_resources().get("CPU", 0.0) < DATA_CPUS:
        if time.monotonic() >= deadline:
            total = ray.cluster_resources().get("CPU", 0.0)
            raise DataError(
                f"data.loader=ray runs Ray Data tasks on CPUs outside the run's pools, but "
                f"the pools and other work hold all {total:g} CPUs of the cluster; leave "
                f"{DATA_CPUS:g} CPU free (a node with more CPUs, or fewer or smaller "
                "bundles: resources.*), or set data.loader=default"
            )
        time.sleep(0.5)
