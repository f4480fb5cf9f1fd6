"""Head surgery for every model family: gate, inspect and physically remove attention heads.

One home for the per-family knowledge of where each layer's heads live: headbudget's own decoder
delegates removal to ``HeadBudgetForCausalLM.prune_heads``, the HF families are cut here.  It sits in
the models layer so that :mod:`headbudget.loading` opens pruned checkpoints (``kept_heads.json``)
with a downward import.

transformers 5 dropped ``head_mask`` and ``prune_heads`` from its models, so every family gets an
adapter that finds each layer's query/key/value/output projections and head counts itself:

* ``"bert"``: BERT-family encoders (BERT, RoBERTa, XLM-R, ELECTRA, all-MiniLM ...), any model that
  contains an ``encoder.layer[i].attention.self.{query,key,value}`` / ``attention.output.dense`` stack
  (so a ``BertModel`` wrapped in a custom pooling/classifier module works too);
* ``"gpt2"``: GPT-2 (``h[i].attn.c_attn`` fused Conv1D + ``c_proj``);
* ``"llama"``: Llama/Mistral/Qwen-style decoders with grouped-query attention
  (``layers[i].self_attn.{q,k,v,o}_proj``);
* ``"headbudget"``: :class:`headbudget.models.HeadBudgetForCausalLM` (delegates removal to the model).

Gating multiplies each head's slice of the *input of the output projection* (a forward pre-hook on
``attention.output.dense`` / ``c_proj`` / ``o_proj``), so a gate of 0 is exactly the same as removing
the head, and ``d loss / d gate`` is the gradient importance of Michel et al.

Grouped-query attention and partial groups.  A key/value head is removed only when all of its query
heads are removed.  When a group loses only some of its queries, the KV head stays and its remaining
queries keep using it.  Because transformers' attention kernels need every KV head to serve the same
number of queries (``num_key_value_groups``), the layer is re-laid out: with ``s_i`` remaining queries
in group ``i`` the new group size is ``g = gcd(s_i)`` and KV head ``i`` is stored ``s_i / g`` times
(exact copies of its k/v rows).  The forward is therefore exact (removed == gated to zero), at the cost
of some duplicated KV rows in layers with uneven groups; ``prune_heads(..., partial_groups="refuse")``
raises instead.  The layout depends only on the set of kept heads, so it is reproduced on load.

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

__all__ = [
    "AdapterBase",
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
