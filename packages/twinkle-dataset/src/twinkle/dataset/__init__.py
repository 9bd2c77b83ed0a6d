"""Datasets for training: load rows from files, hubs or memory, preprocess them, encode them, mix them.

:class:`Dataset` is backed by Hugging Face ``datasets`` (Arrow tables, cached
by fingerprint). Templates and preprocessors are resolved by name through
:mod:`twinkle.registry`, so this package needs neither ``twinkle-template``
nor ``twinkle-preprocessor`` to import.
"""

from twinkle.dataset.dataset import Dataset
from twinkle.dataset.errors import DataProcessingError
from twinkle.dataset.meta import DatasetMeta

__all__ = ["DataProcessingError", "Dataset", "DatasetMeta"]
