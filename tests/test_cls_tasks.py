"""Classification data: SST-5 (PTB trees / SetFit jsonl), MNLI (GLUE TSV / HF glue jsonl), batching."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import names
from headbudget.data.classification import (
    TASKS,
    ClassificationCollator,
    Example,
    TaskDataError,
    get_task,
    load_task,
    make_loader,
    parse_ptb_tree,
    read_glue_mnli_tsv,
    read_ptb_file,
    subsample,
)

FIX = Path(__file__).resolve().parent / "fixtures" / "cls"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "classification" / "sst5"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import BertTokenizer

    return BertTokenizer(str(FIX / "vocab.txt"))


def test_parse_ptb_tree_root_label_and_leaves() -> None:
    ex = parse_ptb_tree("(3 (2 It) (4 (4 (2 's) (4 (3 (2 a) (4 (3 lovely) (2 film))))) (2 .)))")
    assert ex == Example("It 's a lovely film .", 3)
    # PTB escapes undone; a leaf holding two words (as in SST train line 4342) is kept whole
    assert parse_ptb_tree("(2 (2 -LRB-) (2 (2 8 1\\/2) (2 -RRB-)))").text == "( 8 1/2 )"
    assert parse_ptb_tree("(2 (2 -LRB-) (2 x))", unescape=False).text == "-LRB- x"


@pytest.mark.parametrize(
    "tree, parts",
    [  # the offending text where there is one, else the one word that says what is wrong
        ("(3 (2 a) (2 b)", ["unbalanced", "')'"]),
        ("(3 (2 a) (2 b)))", ["unexpected", "')'"]),
        ("(x (2 a))", ["label", "'x'", "integer"]),
        ("(3 (2 a) (7 b))", ["label", "7", "0..4"]),
        ("(3 )", ["label", "3", "children"]),
        ("(3 (2 a)) (2 b)", ["trailing"]),
        ("3 (2 a)", ["'('", "'3'"]),
        ("(3 (2 a) b)", ["words", "subtrees"]),
        ("   ", ["empty"]),
    ],
)
def test_malformed_trees(tree: str, parts: list[str]) -> None:
    with pytest.raises(TaskDataError, match=r"^f\.txt:7: ") as exc:  # the location first, as a compiler's
        parse_ptb_tree(tree, "f.txt:7")
    assert exc.match(names(*parts))


def test_malformed_tree_file_names_file_and_line() -> None:
    with pytest.raises(ValueError, match=names("unbalanced.txt:3", "PTB")):
        read_ptb_file(FIX / "bad" / "unbalanced.txt")
    with pytest.raises(ValueError, match=names("label.txt:2", "PTB", "label", "9", "0..4")):
        read_ptb_file(FIX / "bad" / "label.txt")


def test_load_sst5_ptb() -> None:
    data = load_task("sst5", FIX / "sst5")
    assert data.num_labels == 5 and data.source == "ptb"
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 6, "dev": 2, "test": 3}
    assert [e.label for e in data.train] == [4, 0, 3, 1, 2, 3]  # the blank line is skipped
    assert data.train[4].text == "It ( exists )"
    assert data.train[5].text == "A good 8 1/2 movie"
    assert data.eval_splits == ("dev", "test")
    # a parent folder holding sst5/ works too
    assert len(load_task("sst5", FIX, splits=["dev"]).splits["dev"]) == 2


def test_load_sst5_setfit_jsonl(tmp_path: Path) -> None:
    data = load_task("sst5", FIX / "sst5_setfit")
    assert data.source == "setfit-jsonl"
    assert [(e.text, e.label) for e in data.splits["dev"]] == [("great film", 4), ("worst movie", 0)]
    assert len(data.train) == 3 and len(data.splits["test"]) == 1
    bad = tmp_path / "sst5"
    bad.mkdir()
    shutil.copy(FIX / "bad" / "setfit_label.jsonl", bad / "train.jsonl")
    with pytest.raises(TaskDataError, match=names("train.jsonl:2", "'label'", "7", "0..4")):
        load_task("sst5", bad, splits=["train"])
    shutil.copy(FIX / "bad" / "setfit_json.jsonl", bad / "train.jsonl")
    with pytest.raises(TaskDataError, match=names("train.jsonl:2", "JSON")):
        load_task("sst5", bad, splits=["train"])
    with pytest.raises(FileNotFoundError, match=names("dev", "sst5")):
        load_task("sst5", bad, splits=["dev"])


def test_load_mnli_glue_tsv() -> None:
    data = load_task("mnli", FIX / "mnli")
    assert data.num_labels == 3 and data.source == "glue-tsv"
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 4, "dev_matched": 2, "dev_mismatched": 3}
    # the '-' gold label row is skipped; labels: entailment 0, neutral 1, contradiction 2
    assert [e.label for e in data.train] == [0, 2, 1, 0]
    assert data.train[2] == Example('A dog runs "fast" .', 1, "The dog is brown .")  # quotes kept as is
    assert data.eval_splits == ("dev_matched", "dev_mismatched")


def test_load_mnli_hf_jsonl() -> None:
    data = load_task("mnli", FIX / "mnli_hf")
    assert data.source == "hf-glue-jsonl"
    assert data.train[1] == Example("A man is eating .", 2, "Nobody eats .")
    assert len(data.splits["dev_mismatched"]) == 1  # label -1 (unlabelled) skipped


def test_bad_tsv_rows_name_the_line() -> None:
    with pytest.raises(TaskDataError, match=names("columns.tsv:3", "12", "3")):
        read_glue_mnli_tsv(FIX / "bad" / "columns.tsv")
    with pytest.raises(TaskDataError, match=names("gold.tsv:3", "gold_label", "'maybe'")):
        read_glue_mnli_tsv(FIX / "bad" / "gold.tsv")


def test_registry_errors() -> None:
    assert set(TASKS) >= {"sst5", "mnli"}
    assert get_task("mnli").sentence_pair
    with pytest.raises(ValueError, match=names("'sst2'", "mnli", "sst5")):
        get_task("sst2")
    with pytest.raises(ValueError, match=names("validation")):
        load_task("sst5", FIX / "sst5", splits=["validation"])
    with pytest.raises(FileNotFoundError, match=names(FIX / "nope")):
        load_task("sst5", FIX / "nope")


def test_collator_pads_dynamically(tokenizer) -> None:
    data = load_task("sst5", FIX / "sst5")
    coll = ClassificationCollator(tokenizer, max_length=64)
    short = coll(data.splits["dev"])  # "great film" / "worst movie": [CLS] w w [SEP]
    assert short["input_ids"].shape == (2, 4)
    assert short["labels"].tolist() == [4, 0]
    mixed = coll([Example("good", 3), Example("a great film .", 4)])
    assert mixed["input_ids"].shape == (2, 6)
    assert mixed["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0], [1] * 6]
    assert coll([Example("a great film .", 4)])["input_ids"].shape == (1, 6)
    trunc = ClassificationCollator(tokenizer, max_length=4)([Example("a great film .", 4)])
    assert trunc["input_ids"].shape == (1, 4)
    pair = coll(load_task("mnli", FIX / "mnli").splits["dev_matched"])
    # [CLS] a cat sleeps . [SEP] | a cat rests . [SEP]
    assert pair["token_type_ids"][0].tolist() == [0] * 6 + [1] * 5
    assert pair["token_type_ids"].shape == pair["input_ids"].shape


def test_loader_is_seeded(tokenizer) -> None:
    data = load_task("sst5", FIX / "sst5")

    def order(seed: int) -> list[int]:
        return torch.cat([b["labels"] for b in make_loader(data.train, tokenizer, 2, True, seed)]).tolist()

    assert order(3) == order(3)
    assert sorted(order(3)) == sorted(e.label for e in data.train)
    assert len(subsample(data.train, 4, seed=1)) == 4 and subsample(data.train, 4, 1) == subsample(
        data.train, 4, 1
    )
    assert subsample(data.train, None) == data.train


@pytest.mark.shared
def test_shared_sst5_sizes() -> None:
    if not SHARED.exists():
        pytest.skip(f"{SHARED} not present")
    data = load_task("sst5", SHARED)
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 8544, "dev": 1101, "test": 2210}
    assert data.splits["dev"][0] == Example(
        "It 's a lovely film with lovely performances by Buy and Accorsi .", 3
    )
    assert sorted({e.label for e in data.train}) == [0, 1, 2, 3, 4]
