"""The per-row functions behind ``Dataset.map``, ``encode`` and ``filter``.

They are module-level functions bound with ``functools.partial`` so that
``datasets`` can hash them (cache fingerprints) and send them to ``num_proc``
worker processes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from datasets import List, Value

from twinkle.data_format import TOKEN_FIELDS, validate_input_feature, validate_trajectory
from twinkle.dataset.row_map import batch_rows
from twinkle.interfaces import Template

#: Encoded token columns are stored as int32 lists, not JSON, so collation reads them straight from Arrow; so
#: are the image features of vision-language rows (float32 patches as the image processor made them), which
#: are therefore computed once by ``encode`` and never decoded again.
TOKEN_FEATURES: dict[str, Any] = {name: List(Value("int32")) for name in TOKEN_FIELDS} | {
    "length": Value("int64"),
    "mm_token_type_ids": List(Value("int32")),
    "pixel_values": List(List(Value("float32"))),
    "image_grid_thw": List(List(Value("int64"))),
}


def preprocess_row(preprocessor: Callable[[dict[str, Any]], Any], row: dict[str, Any]) -> Any:
    """Run a preprocessor on one row; an output with ``messages`` must be a valid trajectory."""
    output = preprocessor(row)
    if isinstance(output, Mapping) and "messages" in output:
        validate_trajectory(output, "preprocessor output")
    return output


def encode_row(template: Template, add_generation_prompt: bool, row: dict[str, Any]) -> Any:
    """Encode one trajectory; ``None`` (deleted by the template's truncation strategy) drops the row."""
    feature = template.encode(row, add_generation_prompt=add_generation_prompt)  # type: ignore[arg-type]
    return None if feature is None else validate_input_feature(feature, "template output")


def keep_rows(
    batch: dict[str, list[Any]], indices: list[int], predicate: Callable[[dict[str, Any]], Any]
) -> list[bool]:
    """A batched ``Dataset.filter`` function that asks ``predicate`` about one row at a time."""
    return [bool(predicate(row)) for row in batch_rows(batch, len(indices))]
