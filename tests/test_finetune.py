"""Fine-tuning: classifier loading (folders, wheels, pruned models), accuracy, training, run_finetune."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizer

from conftest import names
from headbudget.data.classification import Example
from headbudget.loading import load_model, load_tokenizer, resolve_model
from headbudget.models.surgery import get_adapter
from headbudget.pruning.finetune import (
    evaluate_accuracy,
    finetune,
    predict,
    run_finetune,
    save_classifier,
)
from headbudget.pruning.job import FinetuneJob, FinetuneRecipe

FIX = Path(__file__).resolve().parent / "fixtures" / "cls"


def load_classifier(path, num_labels, label_names=None, seed=0):
    return load_model(path, "classifier", num_labels=num_labels, label_names=label_names, seed=seed)


def resolve_model_dir(path):
    return resolve_model(path).where


def _config(**kw) -> BertConfig:
    return BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        vocab_size=45,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        **kw,
    )


@pytest.fixture(scope="module")
def tokenizer() -> BertTokenizer:
    return BertTokenizer(str(FIX / "vocab.txt"))


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory, tokenizer) -> Path:
    """An all-MiniLM-like layout: <root>/pkg/model/{config.json, model.safetensors, tokenizer}."""
    root = tmp_path_factory.mktemp("wheel")
    model_dir = root / "pkg_model" / "model"
    torch.manual_seed(0)
    BertModel(_config()).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return root


def _toy(n: int) -> list[Example]:
    words = ["a", "the", "film", "movie", "it", "is"]
    out = []
    for i in range(n):
        cue = "good" if i % 2 else "bad"
        out.append(Example(f"{words[i % 6]} {cue} {words[(i + 2) % 6]} .", i % 2))
    return out


def test_resolve_and_load_from_nested_folder_and_wheel(encoder_dir: Path, tmp_path: Path) -> None:
    inner = encoder_dir / "pkg_model" / "model"
    assert resolve_model_dir(encoder_dir) == inner
    state = torch.random.get_rng_state()
    model = load_classifier(encoder_dir, num_labels=5, label_names=list("abcde"), seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the head's init does not touch the global RNG
    assert isinstance(model, BertForSequenceClassification) and model.config.num_labels == 5
    assert model.config.id2label[4] == "e"
    enc = BertModel.from_pretrained(inner)
    assert torch.equal(
        model.bert.encoder.layer[1].attention.self.query.weight,
        enc.encoder.layer[1].attention.self.query.weight,
    )
    same = load_classifier(encoder_dir, num_labels=5, seed=1)
    other = load_classifier(encoder_dir, num_labels=5, seed=2)
    assert torch.equal(same.classifier.weight, model.classifier.weight)
    assert not torch.equal(other.classifier.weight, model.classifier.weight)
    # the .whl itself: unpacked next to it once
    whl = tmp_path / "tiny_model-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as zf:
        for f in inner.iterdir():
            zf.write(f, f"tiny_model/model/{f.name}")
    assert resolve_model_dir(whl) == tmp_path / "tiny_model-0.1.0-py3-none-any" / "tiny_model" / "model"
    assert load_tokenizer(model_dir=whl).convert_tokens_to_ids("good") == 10
    with pytest.raises(FileNotFoundError, match=names(tmp_path / "missing" / "dir")):
        resolve_model_dir(tmp_path / "missing" / "dir")
    (tmp_path / "empty" / "a" / "b").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=names(tmp_path / "empty", "config.json", ".gguf")):
        resolve_model_dir(tmp_path / "empty")


def test_load_classifier_refuses_label_mismatch(tmp_path: Path) -> None:
    BertForSequenceClassification(_config(num_labels=3)).save_pretrained(tmp_path / "cls3")
    with pytest.raises(ValueError, match=names("3-label", "5")):
        load_classifier(tmp_path / "cls3", num_labels=5)
    assert load_classifier(tmp_path / "cls3", num_labels=3).config.num_labels == 3


class _CueModel(nn.Module):
    """Predicts 1 when the token ``good`` (id 10) is present, else 0."""

    def __init__(self) -> None:
        super().__init__()
        self.dummy = nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        hit = (input_ids == 10).any(-1).float()
        return SimpleNamespace(logits=torch.stack([1 - hit, hit], -1) + self.dummy)


def test_evaluate_accuracy_exact(tokenizer) -> None:
    examples = [Example("a good film", 1), Example("a bad film", 0), Example("good", 0), Example("bad .", 0)]
    model = _CueModel()
    model.train()
    assert predict(model, tokenizer, examples, batch_size=3).tolist() == [1, 0, 1, 0]
    assert evaluate_accuracy(model, tokenizer, examples, batch_size=3) == 0.75
    assert model.training  # mode restored
    with pytest.raises(ValueError, match="no examples"):
        evaluate_accuracy(model, tokenizer, [])


def _tiny_classifier(num_labels: int = 2) -> BertForSequenceClassification:
    torch.manual_seed(0)
    return BertForSequenceClassification(_config(num_labels=num_labels, attention_probs_dropout_prob=0.1))


def test_finetune_learns_and_is_reproducible(tokenizer) -> None:
    data = {"train": _toy(16), "dev": _toy(8)}
    runs = []
    for _ in range(2):
        model = _tiny_classifier()
        state = torch.random.get_rng_state()
        hist = finetune(model, tokenizer, data, FinetuneRecipe(epochs=4, lr=1e-2, batch_size=2, seed=5, progress=False))
        assert torch.equal(torch.random.get_rng_state(), state)  # seeded without touching the global RNG
        runs.append((hist, model))
    hist = runs[0][0]
    assert [r["epoch"] for r in hist["epochs"]] == [1, 2, 3, 4]
    assert hist["steps"] == 32 and hist["config"]["total_steps"] == 32
    assert hist["final"] == {"dev": 1.0}
    assert [r["train_loss"] for r in hist["epochs"]] == [r["train_loss"] for r in runs[1][0]["epochs"]]
    assert torch.equal(runs[0][1].classifier.weight, runs[1][1].classifier.weight)
    assert not runs[0][1].training
    capped = finetune(_tiny_classifier(), tokenizer, data,
                      FinetuneRecipe(epochs=4, batch_size=4, max_steps=5, progress=False))
    assert capped["steps"] == 5 and len(capped["epochs"]) == 2
    with pytest.raises(ValueError, match=names("test")):
        finetune(_tiny_classifier(), tokenizer, data, FinetuneRecipe(progress=False), eval_splits=["test"])


class _NanModel(nn.Module):
    """A classifier whose loss is NaN from its second call on."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(1))
        self.calls = 0

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, labels=None):
        self.calls += 1
        loss = (self.w.sum() * input_ids.float().mean()) ** 2
        return SimpleNamespace(loss=loss * float("nan") if self.calls >= 2 else loss)


def test_finetune_stops_on_a_nan_loss_naming_its_first_step(tokenizer) -> None:
    model = _NanModel()
    # the loss is read at log steps (every 10) and at the end of the epoch, not after every step
    with pytest.raises(FloatingPointError, match=names("nan", "step 2")):
        finetune(model, tokenizer, {"train": _toy(8), "dev": _toy(2)}, FinetuneRecipe(epochs=2, batch_size=2, progress=False))
    assert model.calls == 4  # the first epoch's 4 steps ran; it stopped before evaluating or a second epoch


def test_pruned_classifier_saves_loads_and_finetunes(tokenizer, tmp_path: Path) -> None:
    model = _tiny_classifier(5).eval()
    get_adapter(model).prune_heads({0: [0, 2], 1: [3]})
    batch = tokenizer(["a good film .", "the worst"], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = model(**batch).logits
    save_classifier(model, tokenizer, tmp_path / "pruned")
    loaded = load_classifier(tmp_path / "pruned", num_labels=5)
    assert get_adapter(loaded).original_heads() == {0: [1, 3], 1: [0, 1, 2]}
    with torch.no_grad():
        assert (loaded(**batch).logits - want).abs().max().item() <= 1e-6
    hist = finetune(loaded, tokenizer, {"train": _toy(8), "dev": _toy(4)},
                    FinetuneRecipe(epochs=1, batch_size=4, progress=False))
    assert hist["steps"] == 2 and get_adapter(loaded).head_counts() == [2, 3]


def test_run_finetune_end_to_end(encoder_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ft"
    summary = run_finetune(FinetuneJob(str(encoder_dir), "sst5", str(FIX / "sst5"), str(out), epochs=2, lr=1e-3,
                                       batch_size=4, seed=0, progress=False))
    saved = json.loads((out / "finetune.json").read_text())
    assert saved["task"] == "sst5" and saved["splits"] == {"train": 6, "dev": 2, "test": 3}
    assert len(saved["epochs"]) == 2 and set(saved["initial"]) == {"dev", "test"}
    assert saved["steps"] == 4 and saved["final"] == summary["final"]
    assert (out / "finetune.png").stat().st_size > 1000
    assert (out / "kept_heads.json").exists() and (out / "tokenizer.json").exists()
    from headbudget.data.classification import load_task

    data = load_task("sst5", FIX / "sst5")
    model = load_classifier(out, num_labels=5)
    tok = load_tokenizer(model_dir=out)
    for split in ("dev", "test"):
        assert evaluate_accuracy(model, tok, data.splits[split]) == saved["final"][split]
    assert model.config.id2label[0] == "very negative"
