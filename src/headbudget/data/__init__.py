"""Data: sources, the built-in synthetic corpus, tokenizers, prepared memmaps and batch sampling.

    >>> from headbudget.data import prepare_data
    >>> # prepare_data("synthetic:200000", "bpe:512", "runs/cache")  -> PreparedData(train/val memmaps)
"""

from headbudget.data.prepare import PreparedData, prepare_data, token_dtype
from headbudget.data.sources import read_source
from headbudget.data.tokenizers import Tokenizer, make_tokenizer, read_tokenizer

__all__ = ["PreparedData", "prepare_data", "token_dtype", "read_source", "Tokenizer", "read_tokenizer",
           "make_tokenizer"]
