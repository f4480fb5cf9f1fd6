"""The head adapters pruning works through; they live in :mod:`headbudget.models.surgery` (head surgery
for every family, below the loader) and are re-exported here, the name the pruning code and its
users know.

    >>> from headbudget.pruning.adapters import get_adapter, load_pruned, save_pruned
"""

from headbudget.models.surgery import (
    KEPT_HEADS_FILE,
    BertAdapter,
    GPT2Adapter,
    HeadAdapter,
    HeadBudgetAdapter,
    LlamaAdapter,
    get_adapter,
    load_pruned,
    save_pruned,
)

__all__ = [
    "BertAdapter",
    "GPT2Adapter",
    "HeadAdapter",
    "HeadBudgetAdapter",
    "KEPT_HEADS_FILE",
    "LlamaAdapter",
    "get_adapter",
    "load_pruned",
    "save_pruned",
]
