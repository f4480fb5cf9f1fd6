"""Data: sources, the built-in synthetic corpus, prepared memmaps and batch sampling; SST-5/MNLI classification
data (:mod:`headbudget.data.classification`).  Text and JSONL files are read by :mod:`headbudget.io`, tokenizers
live with the model folders they come from (:mod:`headbudget.models.tokenizers`).

    >>> from headbudget.data import prepare_data
    >>> # prepare_data("synthetic:200000", "bpe:512", "runs/cache")  -> PreparedData(train/val memmaps)
"""

from headbudget.data.prepare import PreparedData, prepare_data, token_dtype
from headbudget.data.sources import read_source

__all__ = ["PreparedData", "prepare_data", "token_dtype", "read_source"]
