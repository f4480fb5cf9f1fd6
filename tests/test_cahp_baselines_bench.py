"""benchmarks/cahp_baselines_minilm.py (issue 20's comparison): the pure parts -- Jaccard, aggregation over
seeds, resume bookkeeping, table rendering -- on synthetic rows, and the bf16 recovery fine-tune it can ask for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

from headbudget.pruning.finetune import finetune
from headbudget.pruning.tasks import Example

FIX = Path(__file__).resolve().parent / "fixtures" / "cls"


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# --------------------------------------------------------------------------- finetune(precision=...)
def _toy(n: int) -> list[Example]:
    return [Example(f"the {'good' if i % 2 else 'bad'} film .", i % 2) for i in range(n)]


def test_finetune_bf16_autocasts_training_forward_only() -> None:
    tok = BertTokenizer(str(FIX / "vocab.txt"))
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=45,
        max_position_embeddings=64, num_labels=2))
    seen: list[tuple[bool, torch.dtype]] = []
    model.bert.encoder.layer[0].attention.self.query.register_forward_hook(
        lambda m, i, o: seen.append((model.training, o.dtype)))
    data = {"train": _toy(8), "dev": _toy(4)}
    hist = finetune(model, tok, data, epochs=1, batch_size=4, progress=False, precision="bf16")
    assert hist["config"]["precision"] == "bf16"
    assert {d for training, d in seen if training} == {torch.bfloat16}     # the training forwards
    assert {d for training, d in seen if not training} == {torch.float32}  # the evaluation stays fp32
    assert model.classifier.weight.dtype == torch.float32                  # fp32 weights
    seen.clear()
    finetune(model, tok, data, epochs=1, batch_size=4, progress=False)
    assert {d for _, d in seen} == {torch.float32}                         # default: fp32 throughout
    with pytest.raises(ValueError, match="precision must be fp32 or bf16, got 'fp16'"):
        finetune(model, tok, data, epochs=1, progress=False, precision="fp16")
