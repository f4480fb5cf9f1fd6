"""Old home of the SST-5/MNLI classification data: it lives in :mod:`headbudget.data.classification` (data
sits below pruning); this module re-exports it so ``from headbudget.pruning.tasks import load_task`` keeps
working.

    >>> from headbudget.data.classification import load_task, make_loader
"""

from headbudget.data.classification import (
    TASKS,
    ClassificationCollator,
    Example,
    TaskData,
    TaskDataError,
    TaskSpec,
    get_task,
    iter_batches,
    load_task,
    make_loader,
    parse_ptb_tree,
    read_glue_mnli_tsv,
    read_ptb_file,
    subsample,
)

__all__ = [
    "TASKS", "ClassificationCollator", "Example", "TaskData", "TaskDataError", "TaskSpec", "get_task",
    "iter_batches", "load_task", "make_loader", "parse_ptb_tree", "read_glue_mnli_tsv", "read_ptb_file",
    "subsample",
]
