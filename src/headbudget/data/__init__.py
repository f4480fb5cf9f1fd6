"""Data: sources, the built-in synthetic corpus, tokenizers, prepared memmaps and batch sampling; the one text
and JSONL reader (:mod:`headbudget.data.text`); SST-5/MNLI classification data (:mod:`headbudget.data.classification`).

    >>> from headbudget.data import prepare_data
    >>> # prepare_data("synthetic:200000", "bpe:512", "runs/cache")  -> PreparedData(train/val memmaps)
"""

from headbudget.data.prepare import PreparedData, prepare_data, token_dtype
from headbudget.data.sources import read_source
from headbudget.data.text import iter_jsonl, read_text
from headbudget.data.tokenizers import Tokenizer, make_tokenizer, read_tokenizer

__all__ = ["PreparedData", "prepare_data", "token_dtype", "read_source", "Tokenizer", "read_tokenizer",
           "make_tokenizer", "read_text", "iter_jsonl"]
