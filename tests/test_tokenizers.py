"""Tokenizer round trips: byte, bpe:N (saved/loaded), gpt2 (offline tiktoken), hf:PATH."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import names
from headbudget.models.tokenizers import TokenizerError, make_tokenizer, read_tokenizer

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "data"
GPT2_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "gpt2"
TEXT = (FIXTURES / "tiny.txt").read_text(encoding="utf-8")


def test_byte_round_trip_and_eos(tmp_path):
    tok = make_tokenizer("byte")
    ids = tok.encode("naïve 🙂")
    assert ids[:2] == [110, 97] and len(ids) == len("naïve 🙂".encode())
    assert tok.decode(ids + [tok.eos_id]) == "naïve 🙂"
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert read_tokenizer(tok.save(tmp_path)).encode("abc") == [97, 98, 99]


def test_bpe_trains_saves_and_reloads_identically(tmp_path):
    tok = make_tokenizer("bpe:300", TEXT.splitlines())
    assert tok.vocab_size == 300
    line = "Prism gives early layers few wide heads."
    ids = tok.encode(line)
    assert len(ids) < len(line.encode())  # merges learned from the text compress it
    assert tok.decode(ids) == line
    again = read_tokenizer(tok.save(tmp_path / "tk"))
    assert again.encode(TEXT) == tok.encode(TEXT)
    assert again.decode(again.encode("東京 🙂")) == "東京 🙂"  # byte-level: any text round-trips
    assert again.eos_id == tok.eos_id == 0


def test_bad_specs_are_one_line_errors():
    with pytest.raises(TokenizerError, match=names("'wordpiece'")):
        make_tokenizer("wordpiece")
    with pytest.raises(TokenizerError, match=names("'bpe:many'", "bpe:VOCAB_SIZE")):
        make_tokenizer("bpe:many", ["x"])
    with pytest.raises(TokenizerError, match=names("'bpe:300'")):
        make_tokenizer("bpe:300")
    with pytest.raises(TokenizerError, match=names("/nonexistent/dir/encoder.json")):
        make_tokenizer("gpt2:/nonexistent/dir")


def test_gpt2_hf_tokenizer_reports_encoder_json_before_vocab_bpe(tmp_path):
    from headbudget.models.tokenizers import gpt2_hf_tokenizer

    (tmp_path / "encoder.json").write_text("{not json", encoding="utf-8")
    (tmp_path / "vocab.bpe").write_bytes(b"#version: 0.2\n\xff\xfe\n")  # not UTF-8 either
    with pytest.raises(TokenizerError, match=names(f"{tmp_path / 'encoder.json'}:1")):
        gpt2_hf_tokenizer(tmp_path)


def test_gpt2_offline_matches_known_ids(tmp_path):
    if not GPT2_DIR.is_dir():
        pytest.skip("../shared/data/tokenizers/gpt2 not present")
    tok = make_tokenizer(f"gpt2:{GPT2_DIR}")
    assert tok.encode("hello world") == [31373, 995]  # GPT-2's ids
    assert (tok.vocab_size, tok.eos_id) == (50257, 50256)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert read_tokenizer(tok.save(tmp_path)).encode(" Prism") == tok.encode(" Prism")


def test_hf_tokenizer_from_a_local_folder(tmp_path):
    from transformers import PreTrainedTokenizerFast

    bpe = make_tokenizer("bpe:280", TEXT.splitlines())
    fast = PreTrainedTokenizerFast(tokenizer_object=bpe.tk._tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(str(tmp_path / "hf"))
    tok = make_tokenizer(f"hf:{tmp_path / 'hf'}")
    assert tok.encode("the lazy dog") == bpe.encode("the lazy dog")
    assert tok.eos_id == bpe.eos_id and tok.vocab_size == 280
    assert read_tokenizer(tok.save(tmp_path / "saved")).encode("fox") == bpe.encode("fox")


@pytest.mark.parametrize("spec", ["byte", "bpe:300"])
def test_saved_tokenizer_opens_with_autotokenizer_with_the_same_ids(spec, tmp_path):
    """save() writes the Hugging Face form too: AutoTokenizer on the folder gives headbudget's ids, decodes
    them back, and knows the end-of-text token."""
    from transformers import AutoTokenizer

    tok = make_tokenizer(spec, TEXT.splitlines())
    hf = AutoTokenizer.from_pretrained(tok.save(tmp_path))
    for text in (TEXT, "naïve 🙂 東京\n\ttabs", "literal <|endoftext|> marker"):
        ids = hf(text, add_special_tokens=False)["input_ids"]
        assert ids == tok.encode(text)
        assert hf(text)["input_ids"] == ids  # nothing prepended or appended
        assert hf.decode(ids) == text
    assert (hf.eos_token_id, hf.pad_token_id, len(hf)) == (tok.eos_id, tok.eos_id, tok.vocab_size)
