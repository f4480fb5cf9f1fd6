"""The one text reader and the one JSONL reader (headbudget.io) and the modules that use them."""

from __future__ import annotations

import pytest

from conftest import assert_names, names
from headbudget.io import NotUTF8Error, iter_jsonl, iter_text_lines, read_text


def test_read_text_returns_the_exact_text_and_names_file_byte_offset_line(tmp_path):
    good = tmp_path / "good.txt"
    good.write_bytes("caf\u00e9\r\nna\u00efve\n".encode())
    assert read_text(good) == "caf\u00e9\r\nna\u00efve\n"  # no newline translation
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"one\ntwo caf\xe9\n")
    with pytest.raises(NotUTF8Error) as exc:
        read_text(bad)
    assert_names(str(exc.value), bad, "UTF-8", "0xe9", "offset 11", "line 2")
    assert isinstance(exc.value, ValueError)


def test_read_text_missing_path_names_the_flag_and_never_tries_a_dataset(tmp_path):
    with pytest.raises(FileNotFoundError) as exc:
        read_text(tmp_path / "missing.txt", flag="--eval-data")
    assert_names(str(exc.value), "--eval-data", tmp_path / "missing.txt")
    with pytest.raises(FileNotFoundError, match=names("--data", tmp_path)):
        read_text(tmp_path)  # a folder


def test_iter_text_lines_counts_offsets_across_lines(tmp_path):
    f = tmp_path / "rows.txt"
    f.write_bytes(b"ab\n\ncd\nx\xc3(\n")
    lines = iter_text_lines(f)
    assert [next(lines), next(lines), next(lines)] == [(1, "ab\n"), (2, "\n"), (3, "cd\n")]
    with pytest.raises(NotUTF8Error, match=names(f, "UTF-8", "0xc3", "offset 8", "line 4")):
        next(lines)


def test_iter_jsonl_values_blank_lines_and_errors(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text('{"a": 1}\n\n  \n{"b": [2, "x"]}\n')
    assert list(iter_jsonl(f)) == [(1, {"a": 1}), (4, {"b": [2, "x"]})]

    class MyError(ValueError):
        pass

    f.write_text('{"a": 1}\n{"a": 2,}\n')
    with pytest.raises(MyError) as exc:
        list(iter_jsonl(f, error=MyError))
    assert_names(str(exc.value), f"{f}:2", "JSON", "Expecting property name enclosed in double quotes", "column 9")
    f.write_text('{"a": 1}\n\n[1, 2]\n')
    with pytest.raises(ValueError) as exc:
        list(iter_jsonl(f))
    assert_names(str(exc.value), f"{f}:3", "JSON object", "list")
    f.write_bytes(b'{"a": 1}\n{"a": "\xff"}\n')
    with pytest.raises(NotUTF8Error) as exc:
        list(iter_jsonl(f, error=MyError))
    assert_names(str(exc.value), f, "UTF-8", "0xff", "offset 16", "line 2")


def test_every_reader_of_the_package_goes_through_the_one_text_reader(tmp_path):
    """Every reader goes through the one reader, with each caller's error class."""
    from headbudget.data.classification import TaskDataError, load_task
    from headbudget.data.sources import SourceError, read_source
    from headbudget.evaluation import tasks

    rows = tmp_path / "piqa_validation.jsonl"
    rows.write_text("7\n")
    with pytest.raises(tasks.DataError, match=names(f"{rows}:1", "JSON object", "int")):
        tasks.load_examples("piqa", tmp_path)  # was a TypeError traceback ('in' on an int)
    with pytest.raises(SourceError, match=names(f"{rows}:1", "JSON object", "int")):
        read_source(f"jsonl:{rows}:text")
    sst = tmp_path / "sst5"
    sst.mkdir()
    (sst / "train.txt").write_bytes(b"(3 (2 good) (4 caf\xe9))\n")
    with pytest.raises(NotUTF8Error, match=names(sst / "train.txt", "UTF-8", "0xe9", "offset 18", "line 1")):
        load_task("sst5", tmp_path, splits=["train"])  # was Python's UnicodeDecodeError naming no file
    (sst / "train.jsonl").write_text('{"text": "ok", "label": 1}\n["x"]\n')
    (sst / "train.txt").unlink()
    with pytest.raises(TaskDataError, match=names(f"{sst / 'train.jsonl'}:2", "JSON object", "list")):
        load_task("sst5", tmp_path, splits=["train"])
    mnli = tmp_path / "mnli"
    mnli.mkdir()
    (mnli / "train.tsv").write_bytes(b"sentence1\tsentence2\tgold_label\na\tb\tneutral\nc\td\xff\tneutral\n")
    with pytest.raises(NotUTF8Error, match=names(mnli / "train.tsv", "UTF-8", "0xff", "offset 46", "line 3")):
        load_task("mnli", tmp_path, splits=["train"])
    (mnli / "train.tsv").write_text("sentence1\tsentence2\tgold_label\na\tb\tneutral\nc\td\t-\ne\tf\tentailment\n")
    data = load_task("mnli", tmp_path, splits=["train"])
    assert [(e.text, e.text_pair, e.label) for e in data.train] == [("a", "b", 1), ("e", "f", 0)]


def test_gpt2_tokenizer_files_that_are_not_utf8_name_the_file(tmp_path):
    pytest.importorskip("transformers")
    from headbudget.models.tokenizers import gpt2_hf_tokenizer

    (tmp_path / "encoder.json").write_bytes(b'{"a": 0, "\xe9": 1}')
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    with pytest.raises(NotUTF8Error) as exc:
        gpt2_hf_tokenizer(tmp_path)  # was Python's UnicodeDecodeError naming no file
    assert_names(str(exc.value), tmp_path / "encoder.json", "UTF-8", "0xe9", "offset 10", "line 1")


def test_a_non_utf8_include_path_yaml_names_file_byte_offset_and_line(tmp_path):
    from headbudget.evaluation.harness import _malformed_yaml

    (tmp_path / "ok.yaml").write_text("task: hb_ok\n")
    (tmp_path / "bad.yaml").write_bytes(b"task: hb_bad\n# caf\xe9\n")
    err = _malformed_yaml(tmp_path, "hb_bad")
    assert_names(str(err), tmp_path / "bad.yaml", "UTF-8", "0xe9", "offset 18", "line 2",  # the line was missing
                 "'hb_bad'")
    (tmp_path / "bad.yaml").unlink()
    assert _malformed_yaml(tmp_path, "hb_ok") is None


def test_ptb_and_tsv_files_with_old_mac_line_ends_read_as_in_text_mode(tmp_path):
    """A lone CR ends a line, as text mode read these files before the one reader (which splits at LF only:
    the PTB file was one line, the TSV a csv.Error traceback)."""
    from headbudget.data.classification import TaskDataError, load_task

    sst = tmp_path / "sst5"
    sst.mkdir()
    (sst / "train.txt").write_bytes(b"(3 (2 good) (4 film))\r(1 (1 bad) (2 plot))\r\n(0 (0 awful))\r")
    data = load_task("sst5", tmp_path, splits=["train"])
    assert [(e.text, e.label) for e in data.train] == [("good film", 3), ("bad plot", 1), ("awful", 0)]
    mnli = tmp_path / "mnli"
    mnli.mkdir()
    (mnli / "train.tsv").write_bytes(b"sentence1\tsentence2\tgold_label\ra\tb\tneutral\rc\td\tentailment\r")
    data = load_task("mnli", tmp_path, splits=["train"])
    assert [(e.text, e.text_pair, e.label) for e in data.train] == [("a", "b", 1), ("c", "d", 0)]
    (mnli / "train.tsv").write_bytes(b"sentence1\tsentence2\tgold_label\ra\tb\tneutral\rc\td\r")
    with pytest.raises(TaskDataError, match=names(f"{mnli / 'train.tsv'}:3", "3", "2")):
        load_task("mnli", tmp_path, splits=["train"])
