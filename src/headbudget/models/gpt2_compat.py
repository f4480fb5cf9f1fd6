"""GPT-2 weights -> headbudget: kept as a name for older code; the converter is ``headbudget.models.convert``.

    >>> from transformers import GPT2Config, GPT2LMHeadModel
    >>> hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32))
    >>> model = from_gpt2(hf)
"""

from __future__ import annotations

from headbudget.models.convert import to_headbudget


def from_gpt2(gpt2_model):
    """Convert a ``transformers.GPT2LMHeadModel`` (object, or name/path) into a headbudget model."""
    if isinstance(gpt2_model, str):
        from transformers import GPT2LMHeadModel

        gpt2_model = GPT2LMHeadModel.from_pretrained(gpt2_model)
    return to_headbudget(gpt2_model)
