"""benchmarks/throughput.py: the ratios it reports (wall and CPU seconds, medians and paired) and one tiny
``--loop`` run through headbudget's training loop with either AdamW."""

from __future__ import annotations

import pytest
import torch

from conftest import load_benchmark


@pytest.fixture(scope="module")
def tp():
    return load_benchmark("throughput")


def test_ratios_of_medians_and_of_the_paired_rounds(tp):
    wall = {"uniform": [1.0, 2.0, 1.0], "nanogpt": [2.0, 2.0, 3.0]}
    cpu = {"uniform": [1.0, 1.0, 4.0], "nanogpt": [1.5, 3.0, 4.0]}
    r = tp.ratios(wall, cpu)
    assert r["nanogpt/uniform"] == 0.5  # throughput of nanoGPT over ours (the key RESULTS used before)
    assert r["uniform/nanogpt"] == 2.0  # median 2 s over median 1 s: ours twice as fast
    assert r["uniform/nanogpt paired"] == 2.0  # rounds' own ratios 2, 1, 3
    assert r["uniform/nanogpt cpu"] == 3.0  # medians 3 over 1
    assert r["uniform/nanogpt cpu paired"] == 1.5  # rounds 1.5, 3, 1


def test_like_for_like_ratios_against_uniform_gelu(tp):
    wall = {"uniform": [1.0, 1.0], "uniform-gelu": [1.0, 2.0], "nanogpt": [2.0, 3.0]}
    r = tp.ratios(wall, wall)
    assert r["uniform-gelu/nanogpt cpu paired"] == 1.75  # rounds 2, 1.5
    assert r["uniform/nanogpt paired"] == 2.5
    assert "uniform/uniform-gelu" not in r and "uniform-gelu/uniform" not in r


def test_uniform_gelu_is_ours_with_the_exact_gelu(tp):
    model = tp.build("uniform-gelu", "cpu-tiny", "cpu")
    assert model.config.hidden_act == "gelu" and model.transformer.h[0].mlp.gelu_approximate == "none"


@pytest.mark.parametrize("adamw", ["auto", "loop"])
def test_a_tiny_loop_run_times_wall_and_cpu_seconds(tp, adamw):
    torch.set_num_threads(1)
    out = tp.run_config("cpu-tiny", 2, 16, ["uniform", "prism"], steps=2, warmup=1, device="cpu",
                        dtype=torch.float32, log_every=2, adamw=adamw)
    assert out["loop"] is True and out["log_every"] == 2
    for res in out["results"].values():
        assert len(res["step_s"]) == len(res["cpu_step_s"]) == 2
        assert res["median_step_s"] > 0 and res["median_cpu_step_s"] > 0
    assert set(out["ratios"]) == {"prism/uniform", "uniform/prism", "uniform/prism paired", "uniform/prism cpu",
                                  "uniform/prism cpu paired"}


def test_a_timed_step_is_one_adamw_step_of_the_training_loop(tp):
    """step_fn's step (TrainLoop.step) moves the weights exactly as forward, backward and AdamW by hand."""
    import copy

    torch.manual_seed(0)
    model = tp.build("uniform", "cpu-tiny", "cpu")
    twin, before = copy.deepcopy(model), copy.deepcopy(model)
    batch = torch.randint(0, model.config.vocab_size, (2, 16))
    opt, opt_twin = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, twin))
    tp.step_fn(model, batch, opt, "cpu", torch.float32)()
    twin(batch, labels=batch).loss.backward()
    opt_twin.step()
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)
    assert not torch.equal(next(model.parameters()), next(before.parameters()))  # it did step
