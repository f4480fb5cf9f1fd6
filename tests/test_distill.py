"""Logit distillation: ``headbudget distill`` / ``train --init STUDENT --teacher TEACHER``.

Tiny random Llama models sharing the byte tokenizer: the teacher 2 layers x 4 heads (2 kv groups), 64
wide; the student 1 layer x 2 heads (1 kv group), 32 wide."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_names, error_line, names
from headbudget.cli.main import build_parser, main
from headbudget.models.tokenizers import ByteTokenizer
from headbudget.train import RunConfig, Trainer, train
from headbudget.train.distill import distill_step_loss, distillation_kl, load_teacher


def _llama(path: Path, hidden: int, heads: int, kv: int, layers: int, seed: int, init_range: float = 0.02) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=257, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64,
                      initializer_range=init_range, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    ByteTokenizer().save(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("distill-models")
    # a more peaked teacher than a fresh student (larger init): something to imitate
    teacher = _llama(root / "teacher", hidden=64, heads=4, kv=2, layers=2, seed=1, init_range=0.05)
    student = _llama(root / "student", hidden=32, heads=2, kv=1, layers=1, seed=2)
    return teacher, student


def _cfg(tmp_path: Path, student: Path, teacher: Path | None, **kw) -> RunConfig:
    t = {"steps": 12, "batch_size": 4, "grad_accum": 2, "context": 32, "eval_every": 6, "eval_batches": 2,
         "log_every": 1, "ckpt_every": 0, "warmup_steps": 2, "lr": 3e-3, "progress": False, "threads": 1}
    t.update(kw.pop("train", {}))
    d = {"teacher": str(teacher) if teacher else None, "temperature": 2.0, "alpha": 1.0}
    d.update(kw.pop("distill", {}))
    return RunConfig.from_dict({
        "name": "distill", "model": {"init": str(student)},
        "data": {"source": "synthetic:20000", "tokenizer": "model", "cache_dir": str(tmp_path / "cache")},
        "train": t, "distill": d})


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_loss_is_t2_times_kl_by_hand_and_mixes_with_ce():
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, 7, generator=g), torch.randn(2, 3, 7, generator=g) * 3
    y = torch.tensor([[1, 2, -100], [0, 6, 5]])
    temp = 2.5
    ps = torch.softmax(s.double() / temp, -1)
    pt = torch.softmax(t.double() / temp, -1)
    per_token = (pt * (pt.log() - ps.log())).sum(-1)
    by_hand = per_token[y != -100].mean() * temp ** 2  # 5 tokens, the padded one left out
    assert torch.allclose(distillation_kl(s, t, y, temp).double(), by_hand, atol=1e-6, rtol=1e-5)
    assert float(distillation_kl(s, t, None, temp)) == pytest.approx(float(per_token.mean() * temp ** 2), rel=1e-5)

    class Fixed(torch.nn.Module):  # a "model" returning fixed logits
        def __init__(self, logits):
            super().__init__()
            self.logits = torch.nn.Parameter(logits.clone())

        def forward(self, input_ids, use_cache=False):
            return type("Out", (), {"logits": self.logits})()

    x = torch.zeros(2, 3, dtype=torch.long)
    y = torch.tensor([[1, 2, 3], [0, 6, 5]])
    ce = torch.nn.functional.cross_entropy(s.reshape(-1, 7), y.reshape(-1))
    kl = distillation_kl(s, t, y, temp)
    loss, parts = distill_step_loss(Fixed(s), Fixed(t), x, y, temp, 0.3, 7)
    assert torch.allclose(loss, 0.3 * kl + 0.7 * ce) and torch.allclose(parts, torch.stack([kl, ce]))
    loss0, _ = distill_step_loss(Fixed(s), Fixed(t), x, y, temp, 0.0, 7)
    assert torch.equal(loss0, ce)
    # differently padded vocabularies: compared over the tokenizer's 5 ids
    wide = torch.cat([t[..., :5], torch.full((2, 3, 4), 9.0)], -1)
    _, parts = distill_step_loss(Fixed(s), Fixed(wide), x, y, temp, 1.0, 5)
    assert torch.allclose(parts[0], distillation_kl(s[..., :5], t[..., :5], y, temp))


def test_alpha_zero_is_plain_lm_training_bit_for_bit(tmp_path, models):
    teacher, student = models
    plain = Trainer(_cfg(tmp_path, student, None), tmp_path / "plain", save_model=False)
    plain.run()
    zero = Trainer(_cfg(tmp_path, student, teacher, distill={"alpha": 0.0}), tmp_path / "zero", save_model=False)
    zero.run()
    a, b = _metrics(tmp_path / "plain"), _metrics(tmp_path / "zero")
    assert [(r["train_loss"], r["val_loss"], r["grad_norm"]) for r in a] == \
           [(r["train_loss"], r["val_loss"], r["grad_norm"]) for r in b]
    assert all(r["lm_loss"] == r["train_loss"] and r["distill_kl"] > 0 for r in b)
    for (k, v), w in zip(plain.model.state_dict().items(), zero.model.state_dict().values()):
        assert torch.equal(v, w), k


def test_smaller_student_learns_the_teacher_which_stays_frozen(tmp_path, models):
    teacher, student = models
    ref = load_teacher(str(teacher), ByteTokenizer().to_hf(), torch.device("cpu"))
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    cfg = _cfg(tmp_path, student, teacher, train={"steps": 30, "lr": 1e-2, "eval_every": 30})
    trainer = Trainer(cfg, tmp_path / "run")
    result = trainer.run()
    kls = [r["distill_kl"] for r in _metrics(tmp_path / "run")]
    assert len(kls) == 30 and kls[-1] < 0.6 * kls[0], kls  # measured: 0.088 -> 0.038
    assert [r["train_loss"] for r in _metrics(tmp_path / "run")] == kls  # alpha=1: the loss is the KL

    # the same KL measured afresh on a fixed batch of the kind of text it trained on, before and after
    from headbudget.data.synthetic import generate_text

    x = torch.tensor(ByteTokenizer().encode(generate_text(200, seed=7))[:128]).view(4, 32)
    with torch.no_grad():
        t_logits = ref(input_ids=x).logits
        from headbudget.loading import load_model

        kl0 = distillation_kl(load_model(student)(input_ids=x).logits, t_logits, None, 2.0)
        kl1 = distillation_kl(load_model(result.model_dir)(input_ids=x).logits, t_logits, None, 2.0)
    assert float(kl1) < 0.6 * float(kl0)

    # the teacher got no gradient and is unchanged on disk
    assert all(not p.requires_grad and p.grad is None for p in ref.parameters())
    again = load_teacher(str(teacher), ByteTokenizer().to_hf(), torch.device("cpu")).state_dict()
    assert all(torch.equal(before[k], again[k]) for k in before)

    # the output folder: the student's layout (1 layer, 2 heads of 16, 1 kv group), opens with transformers
    from transformers import AutoModelForCausalLM

    out = AutoModelForCausalLM.from_pretrained(str(result.model_dir), trust_remote_code=True)
    assert out.get_input_embeddings().weight.shape == (257, 32)
    assert trainer.model.head_counts == [2]
    attn = trainer.model.transformer.h[0].attn
    assert (attn.n_kv_heads if hasattr(attn, "n_kv_heads") else None) in (1, None)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["distill"] == {"teacher": str(teacher), "temperature": 2.0, "alpha": 1.0, "teacher_cache": None}


class Kill(Exception):
    pass


def test_resume_after_interruption_is_bit_identical(tmp_path, models):
    teacher, student = models
    cfg = _cfg(tmp_path, student, teacher, train={"ckpt_every": 4}, distill={"alpha": 0.5})
    straight = Trainer(cfg, tmp_path / "straight", save_model=False)
    straight.run()

    def kill_at_8(trainer, step, record):
        if step == 8:
            raise Kill

    with pytest.raises(Kill):
        train(cfg, tmp_path / "killed", callbacks=[kill_at_8], save_model=False)
    resumed = Trainer(cfg, tmp_path / "killed", resume=True, save_model=False)
    resumed.run()
    a, b = _metrics(tmp_path / "straight"), _metrics(tmp_path / "killed")
    assert [r["step"] for r in b] == list(range(1, 13))
    keys = ("train_loss", "val_loss", "grad_norm", "distill_kl", "lm_loss")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    for (k, v), w in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(v, w), k
    # resuming with another teacher setting is refused in one line
    other = _cfg(tmp_path, student, teacher, train={"ckpt_every": 4}, distill={"alpha": 0.7})
    with pytest.raises(ValueError, match=names("distill.alpha=0.5", "0.7")):
        Trainer(other, tmp_path / "killed", resume=True).run()


def test_a_teacher_with_another_tokenizer_is_refused_in_one_line(tmp_path, models, capsys):
    teacher, student = models
    from headbudget.models.tokenizers import make_tokenizer

    other = tmp_path / "other-teacher"
    _llama(other, hidden=32, heads=2, kv=1, layers=1, seed=3)
    (other / "tokenizer_spec.json").unlink()
    for f in other.glob("tokenizer*"):
        f.unlink()
    make_tokenizer("bpe:300", ["the cat sat on the mat and the dog sat on the log"] * 50).save(other)
    capsys.readouterr()
    rc = main(["distill", str(student), "--teacher", str(other), "--data", "synthetic:20000", "--tokens", "256",
               "--out", str(tmp_path / "out"), "--set", f"data.cache_dir={tmp_path / 'cache'}",
               "--set", "train.context=32", "--set", "train.batch_size=4", "--set", "train.progress=false"])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "distill"), f"distill.teacher={other}")
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_distill_command_equals_train_init_teacher(tmp_path, models, capsys):
    teacher, student = models
    small = ["--set", f"data.cache_dir={tmp_path / 'cache'}", "--set", "train.context=32",
             "--set", "train.batch_size=4", "--set", "train.progress=false", "--set", "train.eval_every=3",
             "--set", "train.eval_batches=1", "--set", "train.log_every=1", "--set", "train.warmup_steps=1",
             "--threads", "1"]
    # 300 tokens at 4 x 32 per step: 3 steps
    assert main(["distill", str(student), "--teacher", str(teacher), "--data", "synthetic:20000", "--tokens", "300",
                 "--alpha", "0.5", "--out", str(tmp_path / "d"), *small]) == 0
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("name: distill\ntrain: {lr: 1.0e-4, steps: 3}\ndata: {source: 'synthetic:20000'}\n"
                   "distill: {alpha: 0.5}\n")
    assert main(["train", str(cfg), "--init", str(student), "--teacher", str(teacher), "--out", str(tmp_path / "t"),
                 *small]) == 0
    assert "distilling" in capsys.readouterr().out
    a, b = _metrics(tmp_path / "d"), _metrics(tmp_path / "t")
    assert len(a) == 3 and [r["distill_kl"] for r in a] == [r["distill_kl"] for r in b]
    from headbudget.loading import load_model

    ma, mb = load_model(tmp_path / "d"), load_model(tmp_path / "t")
    for (k, v), w in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(v, w), k


@pytest.mark.parametrize(("flags", "values"), [
    (["--tokens", "lots"], ("train.tokens", "--tokens", "'lots'")),
    (["--tokens", "1M", "--alpha", "1.5"], ("distill.alpha", 0, 1, 1.5)),
    (["--tokens", "1M", "--temperature", "0"], ("distill.temperature", "0.0")),
    (["--tokens", "1M", "--teacher", "/nonexistent/teacher"], ("distill.teacher", "/nonexistent/teacher")),
])
def test_bad_distill_flags_are_one_line(tmp_path, models, capsys, flags, values):
    teacher, student = models
    rc = main(["distill", str(student), "--teacher", str(teacher), "--out", str(tmp_path / "o"),
               "--data", "synthetic:20000", "--set", f"data.cache_dir={tmp_path / 'cache'}", *flags])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "distill"), *values)
    assert not (tmp_path / "o").exists()


def _ddp_worker(rank: int, world: int, port: int, cfg_dict: dict, out: str) -> None:
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch.distributed as dist

    trainer = Trainer(RunConfig.from_dict(cfg_dict), out, save_model=False)
    result = trainer.run()
    if rank == 0:
        torch.save({"state": trainer.model.state_dict(), "kl": [r["distill_kl"] for r in result.history]},
                   Path(out) / "rank0.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_two_processes_distil_like_one(tmp_path, models, fsdp):
    """Each rank loads its own teacher (never sharded); 2 gloo processes match one on the same global batch."""
    import torch.multiprocessing as mp
    from tests.test_train_ddp import _free_port

    teacher, student = models
    cfg = _cfg(tmp_path, student, teacher, train={"steps": 3, "eval_every": 3, "fsdp": fsdp},
               distill={"alpha": 0.5})
    single = Trainer(cfg, tmp_path / "single", save_model=False)
    single.run()
    mp.spawn(_ddp_worker, args=(2, _free_port(), cfg.to_dict(), str(tmp_path / "two")), nprocs=2, join=True)
    got = torch.load(tmp_path / "two" / "rank0.pt", weights_only=True)
    want = [r["distill_kl"] for r in _metrics(tmp_path / "single")]
    assert got["kl"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    ref = single.model.state_dict()
    worst = max((v - ref[k]).abs().max().item() for k, v in got["state"].items())
    assert worst < 1e-5, worst


@pytest.mark.parametrize("how", ["no flag", "config without data", "--data", "--set", "config with data"])
def test_distill_without_data_is_refused_before_any_work(tmp_path, capsys, how):
    """The default data.source is the built-in synthetic corpus: distill refuses to train on it unless the data is
    named (--data, --set data.source or the config file's data.source); checked before torch is loaded."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("train: {lr: 1.0e-4}\n" + ("data: {source: 'corpus.txt'}\n" if how == "config with data" else ""))
    argv = ["distill", "runs/s", "--teacher", "runs/t", "--out", str(tmp_path / "o")]
    argv += {"no flag": [], "config without data": ["--config", str(cfg)], "--data": ["--data", "corpus.txt"],
             "--set": ["--set", "data.source=corpus.txt"], "config with data": ["--config", str(cfg)]}[how]
    args = build_parser("distill").parse_args(argv)
    if how in ("no flag", "config without data"):
        with pytest.raises(ValueError, match=names("--data", "data.source")):
            args.validate(args)
        assert main(argv) == 2
        assert_names(error_line(capsys.readouterr().err, "distill"), "--data", "data.source")
        assert not (tmp_path / "o").exists()
    else:
        args.validate(args)
        assert args.cfg.data.source == "corpus.txt"
    # --print_config trains nothing: it shows the run either way
    assert main([*argv, "--print_config"]) == 0


def _word_level(vocab: dict[str, int]):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw)


def test_a_teacher_tokenizer_with_the_same_tokens_under_other_ids_is_refused():
    from headbudget.train.distill import TokenizerMismatchError, check_same_tokenizer

    student = _word_level({"[UNK]": 0, "cat": 1, "dog": 2, "mat": 3})
    same = _word_level({"[UNK]": 0, "cat": 1, "dog": 2, "mat": 3})
    check_same_tokenizer(student, same, "t")  # equal maps pass
    # the same four strings, "cat" and "dog" swapped: every text becomes other ids, so the teacher's
    # distribution over ids is not the student's
    swapped = _word_level({"[UNK]": 0, "dog": 1, "cat": 2, "mat": 3})
    assert sorted(swapped.get_vocab()) == sorted(student.get_vocab())
    assert student.encode("cat dog") != swapped.encode("cat dog")
    # the teacher, the vocabulary size, the first token that differs and its two ids
    with pytest.raises(TokenizerMismatchError, match=names("distill.teacher=t", 4, "'cat'", 1, 2)):
        check_same_tokenizer(student, swapped, "t")


def test_the_teacher_runs_in_eval_mode_so_its_dropout_never_reaches_the_targets(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(4)
    cfg = LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      attention_dropout=0.5, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "dropout-teacher")
    ByteTokenizer().save(tmp_path / "dropout-teacher")
    teacher = load_teacher(str(tmp_path / "dropout-teacher"), ByteTokenizer().to_hf(), torch.device("cpu"))
    assert [n for n, m in teacher.named_modules() if m.training] == []
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = teacher(input_ids=x).logits, teacher(input_ids=x).logits
        assert torch.equal(a, b)  # the same targets on every call
        teacher.train()  # the payload is live: with dropout on, two calls give other targets
        assert not torch.equal(teacher(input_ids=x).logits, a)


def test_a_padded_student_is_distilled_over_the_tokenizer_ids(tmp_path, models, monkeypatch):
    """A fresh student pads the byte tokenizer's 257 ids to 320 output rows; the teacher has 257.  The KL
    compares the 257 ids both share (the padded rows are no token), computed against a teacher in eval mode."""
    from headbudget.train import trainer as trainer_mod
    from headbudget.train.distill import distill_step_loss as real

    teacher, _ = models
    calls = []

    def spy(student, teacher_model, x, y, temperature, alpha, vocab, cache=None):
        loss, parts = real(student, teacher_model, x, y, temperature, alpha, vocab, cache)
        with torch.no_grad():
            s, t = student(input_ids=x).logits, teacher_model(input_ids=x).logits
            by_hand = distillation_kl(s[..., :257], t, y, temperature)
        calls.append((vocab, s.shape[-1], t.shape[-1], teacher_model.training, float(parts[0]), float(by_hand)))
        return loss, parts

    monkeypatch.setattr(trainer_mod, "distill_step_loss", spy)
    cfg = RunConfig.from_dict({
        "name": "padded", "model": {"n_layers": 1, "d_model": 32, "n_heads": 2},
        "data": {"source": "synthetic:20000", "tokenizer": "byte", "cache_dir": str(tmp_path / "cache")},
        "train": {"steps": 2, "batch_size": 2, "context": 16, "eval_every": 1, "eval_batches": 1, "log_every": 1,
                  "ckpt_every": 0, "warmup_steps": 1, "progress": False, "threads": 1},
        "distill": {"teacher": str(teacher), "temperature": 2.0, "alpha": 1.0}})
    Trainer(cfg, tmp_path / "run", save_model=False).run()
    assert len(calls) == 2
    for vocab, s_width, t_width, teacher_training, kl, by_hand in calls:
        assert (vocab, s_width, t_width, teacher_training) == (257, 320, 257, False)
        assert kl == pytest.approx(by_hand, rel=1e-5)
    assert [r["distill_kl"] for r in _metrics(tmp_path / "run")] == pytest.approx([c[4] for c in calls], rel=1e-6)


def test_train_init_takes_distills_data_and_tokens_flags(tmp_path, models, capsys):
    """Recovery without a teacher (train --init) takes --data and --tokens as distill does: the same config as
    the long spellings, and the same data and token count as distill's."""
    teacher, student = models

    def printed(argv):
        assert main([*argv, "--print_config"]) == 0
        return capsys.readouterr().out

    short = printed(["train", "quickstart", "--init", str(student), "--data", "synthetic:20000", "--tokens", "300"])
    long = printed(["train", "quickstart", "--init", str(student), "--data.source", "synthetic:20000",
                    "--train.tokens", "300"])
    assert short == long
    assert "source: synthetic:20000" in short and "tokens: '300'" in short and f"init: {student}" in short
    import yaml

    ours = yaml.safe_load(short)
    theirs = yaml.safe_load(printed(["distill", str(student), "--config", "quickstart", "--teacher", str(teacher),
                                     "--data", "synthetic:20000", "--tokens", "300"]))
    assert ours["data"] == theirs["data"] and ours["train"]["tokens"] == theirs["train"]["tokens"] == "300"
    assert ours["model"]["init"] == theirs["model"]["init"] == str(student)


def test_chunked_kl_equals_the_plain_formula_in_value_and_gradient():
    """The chunked KL (forward and backward by rows) against log_softmax/kl_div on whole tensors, fp32 and bf16,
    with ignored positions and a last chunk shorter than the others."""
    import torch.nn.functional as F

    def plain(s, t, y, T):
        per = F.kl_div(F.log_softmax(s.float() / T, -1), F.log_softmax(t.float() / T, -1), reduction="none",
                       log_target=True).sum(-1)
        return per[y != -100].mean() * T * T

    g = torch.Generator().manual_seed(5)
    y = torch.randint(0, 50, (3, 7), generator=g)
    y[1, 2:5] = -100
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        s = (torch.randn(3, 7, 50, generator=g) * 2).to(dtype).requires_grad_(True)
        t = (torch.randn(3, 7, 50, generator=g) * 3).to(dtype)
        for rows in (1, 4, 16, 64):
            got = distillation_kl(s, t, y, 2.0, rows=rows)
            want = plain(s, t, y, 2.0)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            g_got, = torch.autograd.grad(got, s)
            g_want, = torch.autograd.grad(want, s)
            assert g_got.dtype == dtype
            torch.testing.assert_close(g_got.float(), g_want.float(), rtol=tol, atol=tol * 1e-2)
            assert float(g_got[1, 3].abs().sum()) == 0  # an ignored position gets no gradient


def test_teacher_cache_runs_the_teacher_once_per_batch_and_gives_its_exact_logits(tmp_path, models):
    from headbudget.train.distill import TeacherCache

    teacher_dir, student_dir = models
    teacher = load_teacher(str(teacher_dir), ByteTokenizer().to_hf(), torch.device("cpu"))
    body = []
    teacher.model.layers[0].register_forward_hook(lambda *a: body.append(1))
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    want = teacher(input_ids=x, use_cache=False).logits
    body.clear()
    cache = TeacherCache(tmp_path / "c", teacher)
    a, b = cache.logits(x), cache.logits(x)
    assert len(body) == 1 and (cache.hits, cache.misses) == (1, 1)
    assert torch.equal(a, want) and torch.equal(b, want)
    assert len(list(cache.dir.glob("*.safetensors"))) == 1
    cache.logits(x.flip(1))
    assert cache.misses == 2 and len(body) == 2
    other = load_teacher(str(student_dir), ByteTokenizer().to_hf(), torch.device("cpu"))
    assert TeacherCache(tmp_path / "c", other).dir != cache.dir
    # a teacher whose logits are not its output layer's (soft-capped) is refused, not silently mis-cached
    teacher.register_forward_hook(lambda m, a, out: out.__setitem__("logits", 5 * torch.tanh(out.logits / 5)))
    with pytest.raises(ValueError, match=names("distill.teacher_cache", "output layer")):
        TeacherCache(tmp_path / "d", teacher).logits(x)
    assert not any((tmp_path / "d").rglob("*.safetensors"))


def test_a_second_student_reads_the_teacher_from_the_cache_and_trains_identically(tmp_path, models):
    teacher, student = models
    keys = ("train_loss", "val_loss", "grad_norm", "distill_kl", "lm_loss")
    plain = Trainer(_cfg(tmp_path, student, teacher), tmp_path / "plain", save_model=False)
    plain.run()
    d = {"teacher_cache": str(tmp_path / "tc")}
    first = Trainer(_cfg(tmp_path, student, teacher, distill=d), tmp_path / "a", save_model=False)
    first.run()
    second = Trainer(_cfg(tmp_path, student, teacher, distill=d), tmp_path / "b", save_model=False)
    second.run()
    assert first.summary["distill"]["cache"]["misses"] == 24 and first.summary["distill"]["cache"]["hits"] == 0
    assert second.summary["distill"]["cache"] == {**first.summary["distill"]["cache"], "hits": 24, "misses": 0}
    want = [[r[k] for k in keys] for r in _metrics(tmp_path / "plain")]
    assert [[r[k] for k in keys] for r in _metrics(tmp_path / "a")] == want
    assert [[r[k] for k in keys] for r in _metrics(tmp_path / "b")] == want


def test_chunked_cross_entropy_equals_torchs():
    from headbudget.train.distill import chunked_cross_entropy

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 9, 30, generator=g) * 4
    y = torch.randint(0, 30, (3, 9), generator=g)
    y[0, :4] = -100
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 30), y.reshape(-1))
    for rows in (1, 5, 64):
        torch.testing.assert_close(chunked_cross_entropy(logits, y, rows=rows), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(chunked_cross_entropy(logits.bfloat16(), y),
                               torch.nn.functional.cross_entropy(logits.bfloat16().float().reshape(-1, 30), y.reshape(-1)))


@pytest.mark.parametrize("where", ["student", "out"])
def test_a_teacher_cache_inside_an_input_or_the_output_is_refused(tmp_path, models, capsys, where):
    teacher, student = models
    before = {f.name: f.read_bytes() for f in student.iterdir() if f.is_file()}
    out = tmp_path / "o"
    if where == "out":  # an earlier run's folder, which --overwrite would replace (and the cache in it)
        out.mkdir()
        (out / "summary.json").write_text("{}")
    cache = student / "tc" if where == "student" else out / "tc"
    rc = main(["distill", str(student), "--teacher", str(teacher), "--out", str(out), "--tokens", "1M",
               "--data", "synthetic:20000", "--set", f"data.cache_dir={tmp_path / 'cache'}",
               "--teacher-cache", str(cache), *(["--overwrite"] if where == "out" else [])])
    assert rc == 2
    assert_names(error_line(capsys.readouterr().err, "distill"), "--teacher-cache", cache,
                 "STUDENT" if where == "student" else "--out")
    assert {f.name: f.read_bytes() for f in student.iterdir() if f.is_file()} == before
    assert not cache.exists()
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"] if where == "out" else not out.exists()
