"""The plan in a plain PyTorch loop: a batch sampler that yields exactly one rank's planned micro-batches, and
the per-micro-batch loss weights and step denominators of the token-exact loss.

``PlanBatchSampler(plan, example_ids, rank)`` plugs into ``torch.utils.data.DataLoader(batch_sampler=...)``.
It is already rank-aware: give each process its own rank and do not wrap the loader in a
``DistributedSampler`` or let Accelerate shard it again (see :mod:`ray_cluster_ft.integrations.hf`).

The token-exact loss of an optimizer step (docs/design.md, "The published method beside ours") is

    L = sum_{ranks, micro-batches of the step} S_mb / D,   S_mb = sum_{i in mb} w_i sum_t l_it,
    D = sum_{i in step, all ranks} w_i |T_i|

where ``l_it`` is the next-token cross-entropy of label token t of example i, ``|T_i|`` its label tokens
(``labels[t] != -100`` for ``t >= 1``) and ``w_i`` its selection weight (1 unweighted). ``S_mb`` is
:func:`ray_cluster_ft.train.step.token_exact_loss`; ``D`` is precomputed from the plan by
:func:`ray_cluster_ft.train.build_rank_tables` and handed out per micro-batch by :func:`plan_loss_weights`.
What to backpropagate per micro-batch depends on what the surrounding code does to a loss
(:meth:`MicroBatchWeights.loss_scale`, :func:`micro_batch_loss`):

========================================================================  =====================================
gradient handling                                                         backpropagate ``S_mb *``
========================================================================  =====================================
one process, G micro-batches' gradients summed, then ``opt.step()``       ``1 / D``        (``loss_scale(1)``)
DDP (averages over W ranks), G ``backward()`` summed, then ``opt.step()``  ``W / D``        (``loss_scale(W)``)
the backward divides by G as well (DeepSpeed ``engine.backward``,          ``W * G / D``    (``loss_scale(W, G)``)
Accelerate ``accelerator.backward`` with ``gradient_accumulation_steps``,
HF ``Trainer`` without ``loss_is_scaled_for_ga``)
========================================================================  =====================================

In every row the gradient the optimizer applies is ``dL/dtheta``: every label token of the step weighs
``w_i / D`` whatever micro-batch or rank it landed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch
from torch.utils.data import Dataset, Sampler

from ..allocate import check_plan
from ..data.collate import IGNORE_INDEX, collate, pack
from ..train import build_rank_tables
from ..train.rank_data import MICRO_BATCH_KEY, label_token_counts
from ..train.step import token_exact_loss
from ._launch import world_size_message

__all__ = [
    "ExamplesDataset",
    "MicroBatchWeights",
    "PlanBatchSampler",
    "PlanShape",
    "TokenCollator",
    "is_packed_plan",
    "loss_positions",
    "micro_batch_loss",
    "plan_loss_weights",
    "plan_shape",
    "replan",
]

_NEEDED = ("epoch", "step", "rank", "micro_index", "example_id")


@dataclass(frozen=True)
class PlanShape:
    """The sizes a plan fixes.

    Attributes:
        world_size: data-parallel ranks W.
        micro_batch_size: rows per micro-batch B.
        grad_accum: micro-batches per optimizer step on each rank G (the plan's ``micro_index`` count).
        steps: optimizer steps over all epochs.
    """

    world_size: int
    micro_batch_size: int
    grad_accum: int
    steps: int

    @property
    def micro_batches_per_rank(self) -> int:
        """``steps * grad_accum``: the length of every rank's :class:`PlanBatchSampler`."""
        return self.steps * self.grad_accum


def plan_shape(plan: pd.DataFrame, world_size: int | None = None, packed: bool = False) -> PlanShape:
    """Read W, B and G off a plan and enforce its hard rules with :func:`ray_cluster_ft.allocate.check_plan`.

    Args:
        plan: the allocation plan (``plan.parquet``): columns ``epoch, step, rank, micro_index, example_id``
            (+ any others).
        world_size: the ranks the caller runs; ``None`` takes ``max(rank) + 1``.
        packed: a packed plan (``allocation.packing``): any number of rows per micro-batch, so the rules are
            checked on one row per micro-batch and ``micro_batch_size`` is the most rows of any pack.

    Returns:
        :class:`PlanShape`.

    Raises:
        ValueError: not a DataFrame, missing columns, an empty plan, a ``world_size`` other than the plan's
            (the message names the launcher's own process count where ``WORLD_SIZE`` is set), or a plan
            ``check_plan`` rejects (uneven micro-batch counts, a step missing a rank, ...).
    """
    if not isinstance(plan, pd.DataFrame):
        raise ValueError(f"plan must be a pandas DataFrame (plan.parquet), got {type(plan).__name__}")
    missing = [c for c in _NEEDED if c not in plan.columns]
    if missing:
        raise ValueError(f"plan is missing columns {missing} (has {list(plan.columns)})")
    if plan.empty:
        raise ValueError("plan is empty: nothing to train")
    planned = int(plan["rank"].max()) + 1
    if world_size is not None and int(world_size) != planned:
        raise ValueError(world_size_message(planned, int(world_size), "this job"))
    w = planned
    b = int(plan.groupby(["rank", "step", "micro_index"], sort=False).size().max())
    g = int(plan["micro_index"].max()) + 1
    steps = check_plan(plan.drop_duplicates(["rank", "epoch", "step", "micro_index"]), w, 1, g) if packed else \
        check_plan(plan, w, b, g)
    return PlanShape(world_size=w, micro_batch_size=b, grad_accum=g, steps=steps)


def is_packed_plan(plan: pd.DataFrame) -> bool:
    """Whether ``plan`` is packed (``allocation.packing``, the default of ``strategy: cluster``): its micro-batches
    do not all hold the same number of rows. Pass the answer as ``packed=`` to :class:`PlanBatchSampler`,
    :class:`TokenCollator` and :func:`plan_loss_weights`."""
    if not isinstance(plan, pd.DataFrame) or any(c not in plan.columns for c in ("rank", "step", "micro_index")):
        return False
    return plan.groupby(["rank", "epoch", "step", "micro_index"] if "epoch" in plan.columns else
                        ["rank", "step", "micro_index"], sort=False).size().nunique() > 1


def replan(plan: pd.DataFrame, example_ids: Sequence[Any], n_tokens: Sequence[int],
           micro_batch_size: int | None = None, allocation=None) -> pd.DataFrame:
    """The plan made again for the token counts your trainer really trains (another chat template, an EOS
    appended, truncation), so the balanced lengths are the trained ones: the same rows, clusters, world size,
    ``grad_accum`` and epochs, an unpacked plan (:func:`ray_cluster_ft.allocate.make_plan`).

    Args:
        plan: the plan to re-make (``plan.parquet``, with its ``cluster`` column), packed or not.
        example_ids: the ids of your tokenized rows; ``n_tokens``: int, their token counts (same length).
        micro_batch_size: rows per micro-batch B; default the plan's (required for a packed plan, whose packs
            hold any number of rows).
        allocation: :class:`ray_cluster_ft.config.AllocationConfig` (or a dict of its keys, e.g. the run's
            ``config.yaml`` ``allocation`` section): ``strategy``, ``seed``, ``pad_tolerance``; default the
            package's defaults. ``packing`` is not used (the new plan is unpacked).

    Returns:
        The new plan (:data:`ray_cluster_ft.allocate.PLAN_COLUMNS`; ``n_tokens`` the counts given). Rows the
        allocator drops to keep every rank's micro-batch count equal are logged (none when the row count is that
        of a whole-step plan, as a run's plan is).

    Raises:
        ValueError: a plan without ``cluster``, planned ids missing from ``example_ids`` (named: rows your
            trainer's processing dropped), a packed plan without ``micro_batch_size``, and what ``make_plan``
            rejects.
    """
    import logging

    from ..allocate import make_plan
    from ..config import AllocationConfig

    packed = is_packed_plan(plan)
    shape = plan_shape(plan, packed=packed)
    if "cluster" not in plan.columns:
        raise ValueError("replan needs the plan's cluster column (plan.parquet has it)")
    if packed and micro_batch_size is None:
        raise ValueError("a packed plan has no micro-batch size: pass micro_batch_size (rows per micro-batch)")
    a = allocation if isinstance(allocation, AllocationConfig) else AllocationConfig(**dict(allocation or {}))
    first = plan.drop_duplicates("example_id")
    lengths = pd.Series(np.asarray(n_tokens, dtype=np.int64), index=[str(x) for x in example_ids])
    ids = first["example_id"].astype(str).to_numpy()
    missing = ids[~np.isin(ids, lengths.index)]
    if missing.size:
        raise ValueError(f"{missing.size} of the plan's {ids.size} rows are not among the tokenized rows, e.g. "
                         f"{missing[:5].tolist()}: your trainer's processing dropped them (a max_length that "
                         f"leaves no label token?); raise the limit or re-select")
    res = make_plan(ids, first["cluster"].to_numpy(np.int64), lengths.loc[ids].to_numpy(), shape.world_size,
                    int(micro_batch_size or shape.micro_batch_size), shape.grad_accum,
                    int(plan["epoch"].nunique()), strategy=a.strategy, seed=a.seed, pad_tolerance=a.pad_tolerance)
    if len(res.dropped):
        dropped = [str(x) for x in res.dropped]  # example ids
        logging.getLogger(__name__).warning("replan: %d of %d rows dropped to give every rank the same micro-batch "
                                            "count (not trained): %s", len(dropped), ids.size, dropped[:20])
    return res.plan


def _check_rank(rank: int, shape: PlanShape) -> int:
    if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)):
        raise ValueError(f"rank must be an int, got {type(rank).__name__}")
    if not 0 <= int(rank) < shape.world_size:
        raise ValueError(
            f"rank {int(rank)} is outside the plan: it has ranks 0..{shape.world_size - 1} (world size "
            f"{shape.world_size}); run with that many processes, or re-plan for your world size"
        )
    return int(rank)


def _rank_rows(plan: pd.DataFrame, rank: int) -> pd.DataFrame:
    """The rank's rows in training order: the same stable sort as :func:`ray_cluster_ft.train.build_rank_tables`,
    so the in-micro-batch position order of the plan is kept."""
    return plan[plan["rank"].to_numpy() == rank].sort_values(MICRO_BATCH_KEY, kind="stable")


def _pack_starts(keys: np.ndarray) -> np.ndarray:
    """Row index where each micro-batch of a rank's rows (``keys``: ``(n, 3)`` epoch, step, micro_index in
    training order) begins."""
    return np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)])


class PlanBatchSampler(Sampler[list[int]]):
    """One rank's planned micro-batches as positions into the user's dataset, for
    ``DataLoader(dataset, batch_sampler=PlanBatchSampler(plan, example_ids, rank))``.

    Iterating yields one ``list[int]`` per planned micro-batch of ``rank`` (``micro_batch_size`` positions
    into ``example_ids``, in plan order: epoch, step, micro_index, then the position in the micro-batch), over
    all epochs of the plan. Every rank has the same ``len()`` (the plan's rules), so the collective ops of
    data-parallel training never wait on a rank that ran out of data. Iterating again yields the same batches
    (the plan already holds every epoch's order; ``set_epoch`` is accepted and ignored).

    Args:
        plan: the allocation plan (``plan.parquet``), columns ``epoch, step, rank, micro_index, example_id``,
            sorted by ``(rank, epoch, step, micro_index, position)``.
        example_ids: the example id (str, or anything ``str()`` maps to the plan's ids) of each row of the
            dataset, in dataset order: ``example_ids[p]`` is the id of ``dataset[p]``.
        rank: this process's data-parallel rank.
        world_size: the number of ranks you run; ``None`` takes the plan's (``max(rank) + 1``).
        packed: a packed plan (``allocation.packing``): each micro-batch is a pack of any number of rows; collate
            it with ``TokenCollator(packed=True)``.

    Attributes:
        rank, world_size, micro_batch_size, grad_accum, steps: the plan's sizes (:class:`PlanShape`).
        positions: int64 ``(len(self), micro_batch_size)``, the positions each micro-batch yields (packed: a
            list of int64 arrays, one per pack).
        keys: int64 ``(len(self), 3)``, the ``(epoch, step, micro_index)`` of each micro-batch.

    Raises:
        ValueError: a plan :func:`plan_shape` rejects, ``rank`` outside ``0..world_size-1``, duplicate ids in
            ``example_ids``, or planned ids (of any rank, so every process fails alike) that ``example_ids``
            lacks.
    """

    def __init__(self, plan: pd.DataFrame, example_ids: Sequence[Any], rank: int, world_size: int | None = None,
                 packed: bool = False):
        shape = plan_shape(plan, world_size, packed)
        self.rank = _check_rank(rank, shape)
        self.world_size = shape.world_size
        self.micro_batch_size = shape.micro_batch_size
        self.grad_accum = shape.grad_accum
        self.steps = shape.steps
        index = pd.Index(np.asarray([str(x) for x in example_ids], dtype=object))
        if index.has_duplicates:
            dup = index[index.duplicated()].unique()[:5].tolist()
            raise ValueError(f"example_ids hold duplicates, e.g. {dup}; each dataset row needs its own id")
        planned = pd.unique(plan["example_id"].astype(str).to_numpy())
        absent = planned[index.get_indexer(planned) < 0]
        if absent.size:
            raise ValueError(
                f"{absent.size} of the plan's {planned.size} example ids are not in the dataset's example_ids "
                f"({len(index)} rows), e.g. {absent[:5].tolist()}; pass the ids of the dataset the plan was "
                f"made from, in dataset order"
            )
        rows = _rank_rows(plan, self.rank)
        pos = index.get_indexer(rows["example_id"].astype(str).to_numpy()).astype(np.int64)
        keys = rows[MICRO_BATCH_KEY].to_numpy(np.int64)
        if packed:
            starts = _pack_starts(keys)
            self.positions = np.split(pos, starts[1:])
            self.keys = keys[starts]
        else:
            self.positions = pos.reshape(-1, self.micro_batch_size)
            self.keys = keys[:: self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        for row in self.positions:
            yield row.tolist()

    def __len__(self) -> int:
        return len(self.positions)

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the plan fixes every epoch's order, and one pass of this sampler covers all epochs."""


@dataclass(frozen=True)
class MicroBatchWeights:
    """What the token-exact loss needs for one planned micro-batch of one rank.

    Attributes:
        epoch, step, micro_index: the micro-batch's place in the plan (``step`` is the global optimizer step).
        example_ids: its ``B`` ids, in the order the sampler yields them.
        weight: float64 ``(B,)``, the selection weights ``w_i`` (ones when unweighted).
        label_tokens: int64 ``(B,)``, ``|T_i|``: label tokens trained per example (``labels[t] != -100``, t >= 1).
        denominator: ``D``, the step's ``sum_i w_i |T_i|`` over all ranks and micro-batches (from the plan's
            ``step_weighted_tokens``).
        lengths: int64 ``(B,)``, tokens per example (``len(input_ids)``): what spreads the weights over a pack's
            tokens.
    """

    epoch: int
    step: int
    micro_index: int
    example_ids: tuple[str, ...]
    weight: np.ndarray
    label_tokens: np.ndarray
    denominator: float
    lengths: np.ndarray | None = None

    def loss_scale(self, world_size: int, grad_accum: int = 1) -> float:
        """``world_size * grad_accum / D``: the factor on ``token_exact_loss`` before ``backward``.

        Args:
            world_size: ranks the gradient is *averaged* over (DDP, DeepSpeed: W; one process: 1).
            grad_accum: the factor the backward divides each micro-batch's loss by (1 when your loop sums the
                micro-batches' gradients itself; G under DeepSpeed's ``engine.backward``, Accelerate's
                ``accelerator.backward`` with ``gradient_accumulation_steps=G``, or an HF ``Trainer`` that
                divides by G). See the module docstring's table.
        """
        return float(world_size) * float(grad_accum) / self.denominator


def plan_loss_weights(plan: pd.DataFrame, examples: pa.Table | pd.DataFrame, rank: int,
                      weights: pd.Series | None = None, world_size: int | None = None,
                      packed: bool = False) -> list[MicroBatchWeights]:
    """Per planned micro-batch of ``rank``, in :class:`PlanBatchSampler` order: the loss weights and the step's
    token denominator, from :func:`ray_cluster_ft.train.build_rank_tables` (the same numbers this project's own
    trainer uses).

    Use it beside the sampler: ``for batch, mw in zip(loader, plan_loss_weights(plan, examples, rank))``.

    Args:
        plan: the allocation plan (see :class:`PlanBatchSampler`).
        examples: ``example_id`` (str), ``input_ids`` and ``labels`` (list<int>, ``-100`` where no loss is taken)
            of at least every planned example (``examples.parquet``). The labels must be the ones your loss
            uses: ``D`` counts them.
        rank: the data-parallel rank.
        weights: per-example loss weight indexed by ``example_id`` (``selection.parquet``'s ``weight``);
            ``None`` weighs every example 1.
        world_size: as in :func:`plan_shape`.
        packed: a packed plan (as :class:`PlanBatchSampler`'s ``packed``).

    Returns:
        ``len(sampler)`` :class:`MicroBatchWeights`.

    Raises:
        ValueError: a plan :func:`plan_shape` rejects, a rank outside the plan, and everything
            ``build_rank_tables`` rejects (planned ids absent from ``examples`` or ``weights``, duplicate ids,
            examples without a label token to train on, weights that are not finite and positive).
    """
    shape = plan_shape(plan, world_size, packed)
    rank = _check_rank(rank, shape)
    t = build_rank_tables(plan, examples, shape.world_size, weights)[rank]
    keys = np.stack([t.column(c).to_numpy() for c in MICRO_BATCH_KEY], axis=1)
    starts = _pack_starts(keys) if packed else np.arange(0, t.num_rows, shape.micro_batch_size)
    ids = np.split(np.asarray(t.column("example_id").to_pylist(), dtype=object), starts[1:])
    w = np.split(t.column("weight").to_numpy(), starts[1:])
    n_lab = np.split(label_token_counts(t.column("labels")), starts[1:])
    lengths = np.split(pc.list_value_length(t.column("input_ids")).to_numpy().astype(np.int64), starts[1:])
    d = t.column("step_weighted_tokens").to_numpy()[starts]
    return [
        MicroBatchWeights(epoch=int(k[0]), step=int(k[1]), micro_index=int(k[2]), example_ids=tuple(ids[j]),
                          weight=w[j].copy(), label_tokens=n_lab[j].copy(), denominator=float(d[j]),
                          lengths=lengths[j].copy())
        for j, k in enumerate(keys[starts])
    ]


def micro_batch_loss(logits: torch.Tensor, labels: torch.Tensor, mw: MicroBatchWeights, world_size: int,
                     grad_accum: int = 1, positions: torch.Tensor | None = None) -> torch.Tensor:
    """``token_exact_loss(logits, labels, w) * mw.loss_scale(world_size, grad_accum)``: the loss to
    backpropagate for one planned micro-batch (see the module docstring for ``world_size`` and ``grad_accum``).

    Args:
        logits: ``(B, T, V)`` causal-LM logits of the micro-batch, or ``(B, K, V)`` at ``positions`` only.
        labels: int64 ``(B, T)``, ``-100`` where no loss is taken (padding included); or, for a pack
            (``TokenCollator(packed=True)``), ``(1, N)`` with ``N = sum(mw.lengths)``: the per-example weights
            then go onto each example's tokens.
        mw: the micro-batch's :class:`MicroBatchWeights`.
        positions: int64 ``(K,)`` on the logits' device: the positions ``logits`` holds, every ``t`` whose next
            token is a label in some row (:func:`loss_positions`; give the model ``logits_to_keep=positions`` so
            its LM head skips prompt tokens and padding). ``None``: ``logits`` holds all ``T``.

    Returns:
        A float32 scalar tensor on ``logits.device``.

    Raises:
        ValueError: ``labels`` do not hold the micro-batch's planned label-token counts (the wrong micro-batch,
            or a collator that changed the labels, so ``D`` would not count the tokens trained); ``positions``
            miss a position whose next token is a label or are not strictly ascending, or ``logits`` do not hold
            one row per position.
    """
    if positions is not None:
        if logits.shape[1] != positions.numel():
            raise ValueError(f"logits hold {logits.shape[1]} positions per row, positions lists {positions.numel()}")
        if positions.numel() > 1 and not bool((positions[1:] > positions[:-1]).all()):
            raise ValueError("positions must be strictly ascending (a repeated position would count its loss twice)")
        need = loss_positions(labels)
        missing = ~torch.isin(need, positions)
        if bool(missing.any()):
            raise ValueError(f"positions miss {int(missing.sum())} position(s) whose next token is a label (first "
                             f"{int(need[missing][0])}): their loss would be left out; pass loss_positions(labels)")
    n_rows = len(mw.weight)
    # One sequence for several rows is a pack (a pack of one row is the same tensor as a padded batch of one).
    is_pack = labels.shape[0] == 1 and n_rows > 1
    if is_pack:
        if mw.lengths is None or labels.shape[1] != int(mw.lengths.sum()):
            raise ValueError(f"micro-batch (epoch {mw.epoch}, step {mw.step}, micro_index {mw.micro_index}): a pack "
                             f"of {labels.shape[1]} tokens, the plan's examples hold {mw.lengths}")
        starts = np.cumsum(mw.lengths) - mw.lengths
        # a pack's first label of each example is -100 (TokenCollator(packed=True)), as the unpacked shift drops it
        got = np.add.reduceat((labels[0] != -100).cpu().numpy(), starts)
    else:
        got = (labels[:, 1:] != -100).sum(dim=1).cpu().numpy()
    if got.shape != mw.label_tokens.shape or not np.array_equal(got, mw.label_tokens):
        raise ValueError(
            f"micro-batch (epoch {mw.epoch}, step {mw.step}, micro_index {mw.micro_index}): the labels hold "
            f"{got.tolist()} label tokens per row, the plan's examples {mw.label_tokens.tolist()}; is this the "
            f"planned micro-batch, and does the collator keep the examples' labels? (the step's token denominator "
            f"counts them)"
        )
    w = torch.as_tensor(mw.weight, dtype=torch.float32, device=logits.device)
    if is_pack:
        w = torch.repeat_interleave(w, torch.as_tensor(mw.lengths, device=logits.device))[None, :]
    return token_exact_loss(logits, labels, w, positions) * mw.loss_scale(world_size, grad_accum)


def loss_positions(labels: torch.Tensor) -> torch.Tensor:
    """The positions whose logits the token-exact loss reads: every ``t`` such that ``labels[b, t + 1]`` is a label
    (not ``-100``) for some row ``b``, on ``labels``' device. Passed to a transformers causal LM
    as ``logits_to_keep`` (a 1-D tensor keeps those positions of every row), its LM head skips prompt tokens and
    padding: the same loss from fewer logits (:func:`micro_batch_loss` with ``positions``). The torch form of
    :func:`ray_cluster_ft.data.collate.logits_positions`, which the project's own trainer uses.

    Args:
        labels: int ``(B, T)``, ``-100`` where no loss is taken.

    Returns:
        int64 ``(K,)``, ascending, each in ``[0, T - 1)``.
    """
    return torch.nonzero((labels[:, 1:] != IGNORE_INDEX).any(dim=0)).flatten()


class ExamplesDataset(Dataset):
    """Tokenized examples (``examples.parquet``) as a map-style dataset.

    Args:
        examples: ``example_id`` (str), ``input_ids`` and ``labels`` (list<int>) per row; other columns are
            ignored.

    Attributes:
        example_ids: list[str], the id of each row, in row order (what :class:`PlanBatchSampler` wants).
        table: the three columns as a ``pyarrow.Table``.

    Items: ``{"example_id": str, "input_ids": list[int], "labels": list[int]}``.

    Raises:
        ValueError: a missing column.
    """

    def __init__(self, examples: pa.Table | pd.DataFrame):
        cols = ["example_id", "input_ids", "labels"]
        have = list(examples.columns) if isinstance(examples, pd.DataFrame) else getattr(examples, "column_names", None)
        if have is None:
            raise ValueError(f"examples must be a pyarrow Table or pandas DataFrame, got {type(examples).__name__}")
        missing = [c for c in cols if c not in have]
        if missing:
            raise ValueError(f"examples are missing columns {missing} (has {have})")
        if isinstance(examples, pd.DataFrame):
            examples = pa.Table.from_pandas(examples[cols], preserve_index=False)
        self.table = examples.select(cols)
        self.example_ids = [str(x) for x in self.table.column("example_id").to_pylist()]
        self._ids = self.table.column("input_ids").to_pylist()
        self._labels = self.table.column("labels").to_pylist()

    def __len__(self) -> int:
        return len(self.example_ids)

    def __getitem__(self, i: int) -> dict:
        return {"example_id": self.example_ids[i], "input_ids": self._ids[i], "labels": self._labels[i]}


class TokenCollator:
    """Right-pad a list of ``{"input_ids", "labels"}`` items into a batch with the project's one collate
    (:func:`ray_cluster_ft.data.collate.collate`).

    With ``packed=True`` the items become one padding-free sequence instead
    (:func:`ray_cluster_ft.data.collate.pack`, transformers' ``DataCollatorWithFlattening``): pass
    ``input_ids`` and ``position_ids`` to the model with no ``attention_mask`` and ``use_cache=False``, and
    transformers keeps attention inside each example.

    Args:
        pad_token_id: id written into padded ``input_ids`` (masked out of attention and loss).
        packed: pack instead of pad (for :class:`PlanBatchSampler` with ``packed=True``).
        flash_attn_kwargs: with ``packed``, also return ``cu_seq_lens_q/k`` and ``max_length_q/k`` for
            ``flash_attention_2`` varlen.

    Returns (when called on B items): ``input_ids``, ``attention_mask``, ``labels``: int64 tensors ``(B, T)``
    (labels ``-100`` on padding; an item without ``labels`` trains on every token); packed: ``input_ids``,
    ``position_ids``, ``labels``: int64 ``(1, N)``; plus ``example_id`` (list[str]) when the items carry it.
    """

    def __init__(self, pad_token_id: int = 0, packed: bool = False, flash_attn_kwargs: bool = False):
        self.pad_token_id = int(pad_token_id)
        self.packed = bool(packed)
        self.flash_attn_kwargs = bool(flash_attn_kwargs)

    def __call__(self, items: list[dict]) -> dict:
        ids = [np.asarray(it["input_ids"], dtype=np.int64) for it in items]
        labels = [np.asarray(it["labels"] if it.get("labels") is not None else it["input_ids"], dtype=np.int64)
                  for it in items]
        if self.packed:
            host = pack(ids, labels, flash_attn_kwargs=self.flash_attn_kwargs)
            host.pop("lengths")
            out: dict[str, Any] = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in host.items()}
        else:
            out = {k: torch.from_numpy(v) for k, v in collate(ids, labels, self.pad_token_id).items()}
        if all("example_id" in it for it in items):
            out["example_id"] = [str(it["example_id"]) for it in items]
        return out
