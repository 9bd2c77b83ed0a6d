"""Encoded rows that train on nothing: every label is ignored, so no token is supervised.

Training stops at a batch made only of such rows ("the batch has no supervised
token"), far from the cause. ``Dataset.encode`` counts them right away, where
the preprocessor and the template that produced them are known: none of the
rows supervised is surely a mistake (a prompt-only preprocessor); some of them
may be rows whose answer truncation cut off, which the user may keep or drop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.compute as pc

from twinkle.data_format import IGNORE_INDEX
from twinkle.dataset.errors import MAX_REPORTED_ROWS
from twinkle.errors import ConfigurationError
from twinkle.utils import get_logger

logger = get_logger(__name__)


def unsupervised_rows(data: datasets.Dataset) -> list[int]:
    """The indices of the encoded rows with no supervised token.

    A token is supervised where its label (``labels``, else ``loss_mask``, as
    collation reads them) trains it, at any position but the first, which
    nothing predicts. Rows with neither column supervise nothing.
    """
    column = next((name for name in ("labels", "loss_mask") if name in data.column_names), None)
    if column is None:
        return list(range(len(data)))
    values = data.with_format("arrow")[column]  # read from Arrow, no row is decoded
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    after_first = pc.list_slice(values, 1)
    ignored = IGNORE_INDEX if column == "labels" else 0
    trained = pc.not_equal(pc.list_flatten(after_first), ignored)
    supervised = pc.unique(pc.list_parent_indices(after_first).filter(trained))
    rows = pa.array(range(len(data)), type=supervised.type)
    without = pc.indices_nonzero(pc.invert(pc.is_in(rows, value_set=supervised)))
    return [int(index) for index in without.to_pylist()]


def check_supervision(
    data: datasets.Dataset, where: str, preprocessors: Sequence[str], template: Any, drop: bool
) -> datasets.Dataset:
    """``data`` (without its unsupervised rows when ``drop``); raises ConfigurationError if no row is supervised,
    else warns about the unsupervised rows it keeps."""
    unsupervised = unsupervised_rows(data)
    if not unsupervised:
        return data
    count, total = len(unsupervised), len(data)
    made_by = f" after {', '.join(preprocessors)}" if preprocessors else ""
    if count == total:
        raise ConfigurationError(
            f"encode on {where}: none of its {total} rows has a supervised token (every label is ignored){made_by}, "
            "so training on it would stop at its first batch ('the batch has no supervised token'). Keep the "
            "assistant's answers in the trajectories (e.g. GSM8KProcessor(include_solution=True) for SFT); for "
            "prompts to sample from, encode(add_generation_prompt=True)."
        )
    if drop:
        logger.info("encode on %s: dropped %d of %d rows with no supervised token", where, count, total)
        unsupervised_set = set(unsupervised)
        return data.select([i for i in range(total) if i not in unsupervised_set])
    shown = ", ".join(map(str, unsupervised[:MAX_REPORTED_ROWS])) + (", ..." if count > MAX_REPORTED_ROWS else "")
    logger.warning(
        "encode on %s: %d of %d rows have no supervised token (rows %s)%s; they may have no assistant answer, or "
        "truncation (max_length=%s, truncation_strategy=%r) cut it off. They train nothing, and a batch made only "
        "of them stops training: encode(drop_unsupervised=True) drops them.",
        where,
        count,
        total,
        shown,
        made_by,
        getattr(template, "max_length", None),
        getattr(template, "truncation_strategy", None),
    )
    return data
