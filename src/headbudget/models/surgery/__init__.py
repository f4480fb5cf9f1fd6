"""Head surgery for every model family: gate, inspect and physically remove attention heads.

transformers 5 dropped ``head_mask`` and ``prune_heads``, so each family gets an adapter that finds every
layer's query/key/value/output projections and head counts itself: ``"bert"`` (any module holding a
BERT-family encoder stack), ``"gpt2"``, ``"llama"`` (Llama/Mistral/Qwen-style grouped-query decoders) and
``"headbudget"`` (delegates removal to ``HeadBudgetForCausalLM.prune_heads``).  It sits in the models layer
so that :mod:`headbudget.loading` opens pruned checkpoints (``kept_heads.json``) with a downward import.

A gate multiplies a head's slice of the output projection's input, so a gate of 0 is exactly removal and
``d loss / d gate`` is Michel et al.'s importance.  A key/value head goes only with all its query heads; the
``llama`` adapter stores a partly pruned group's KV head ``s_i / gcd(s_i)`` times so transformers' kernels
see equal groups (``partial_groups="refuse"`` raises instead).  See docs/pruning-models.md.

    >>> from transformers import BertConfig, BertForSequenceClassification
    >>> model = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2,
    ...     num_attention_heads=4, intermediate_size=64, vocab_size=100))
    >>> adapter = get_adapter(model)
    >>> adapter.prune_heads({0: [1, 3]})
    >>> adapter.head_counts(), adapter.original_heads()[0]
    ([2, 4], [0, 2])
"""

from headbudget.models.surgery.base import KEPT_HEADS_FILE, AdapterBase
from headbudget.models.surgery.checkpoint import load_pruned, save_pruned
from headbudget.models.surgery.families import (
    BertAdapter,
    GPT2Adapter,
    HeadBudgetAdapter,
    LlamaAdapter,
    get_adapter,
)
from headbudget.models.surgery.interface import HeadAdapter

__all__ = ["AdapterBase", "BertAdapter", "GPT2Adapter", "HeadAdapter", "HeadBudgetAdapter", "KEPT_HEADS_FILE",
           "LlamaAdapter", "get_adapter", "load_pruned", "save_pruned"]
