"""``DataLoader`` over HTTP: batches drawn from a dataloader on the server.

A batch is the list of rows itself (``InputFeature`` dicts), so it can be
passed to ``forward_backward`` or ``sample`` as in-process. Epochs behave as
in-process: each ``for`` loop reads the rest of the current epoch and the next
loop starts the next one (the server reshuffles it when ``shuffle``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from twinkle.errors import ConfigurationError
from twinkle_client.context import get_client
from twinkle_client.dataset import Dataset


class DataLoader:
    """Remote twin of ``twinkle.dataloader.DataLoader``; ``dataset`` may be a zero-argument function making one.

    ``device_mesh`` and ``rank`` say how an in-process loader slices batches over data-parallel
    ranks; the server's model takes whole batches, so they are ignored here. A ``processor``
    would collate rows into tensors, which a remote model cannot receive: it is refused.
    """

    def __init__(
        self,
        dataset: Dataset | Callable[[], Dataset],
        batch_size: int,
        min_batch_size: int | None = None,
        shuffle: bool = False,
        seed: int = 42,
        drop_last: bool = False,
        device_mesh: Any = None,
        processor: Any = None,
        rank: int | None = None,
    ) -> None:
        if processor is not None:
            raise ConfigurationError(
                "a remote DataLoader yields lists of rows, which the server's model collates itself; "
                "remove processor= (set one on the model with model.set_processor(...) instead)"
            )
        if not isinstance(dataset, Dataset) and callable(dataset):
            dataset = dataset()
        if not isinstance(dataset, Dataset):
            raise ConfigurationError(
                f"a remote DataLoader reads a twinkle_client Dataset, got {type(dataset).__name__}"
            )
        self.dataset = dataset
        self._options: dict[str, Any] = {"batch_size": batch_size, "shuffle": shuffle, "seed": seed}
        if min_batch_size is not None:
            self._options["min_batch_size"] = min_batch_size
        if drop_last:
            self._options["drop_last"] = True
        self._created: dict[str, Any] | None = None
        self._consumed = 0  # batches of the current epoch received

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._create()["length"]

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        if self._consumed >= len(self):  # the epoch was read to its last batch but its end not yet seen
            self._next_batch()
        while (batch := self._next_batch()) is not None:
            yield batch

    def _next_batch(self) -> list[dict[str, Any]] | None:
        reply = get_client().request("POST", f"/dataloaders/{self._create()['handle']}/next", {})
        if reply.get("end"):
            self._consumed = 0
            return None
        self._consumed += 1
        return reply["batch"]

    def _create(self) -> dict[str, Any]:
        if self._created is None:
            body = {"dataset": self.dataset.handle, **self._options}
            self._created = get_client().request("POST", "/dataloaders", body)
        return self._created
