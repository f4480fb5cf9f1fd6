import json

import pytest

from conftest import names
from headbudget.accounting import count_parameters, flops_per_token
from headbudget.schedule_spec import schedule_from_spec
from headbudget.schedules import (
    PRESETS,
    HeadSchedule,
    LayerSpec,
    ScheduleError,
    from_list,
    linear,
    prism,
    reverse,
)


def test_prism_gpt2_124m_matches_paper_schedule():
    s = prism(12, 768, 256, 64)
    assert s.heads == (3, 3, 3, 3, 6, 6, 6, 6, 12, 12, 12, 12)
    assert s.head_dims == (256,) * 4 + (128,) * 4 + (64,) * 4
    assert all(spec.width == 768 for spec in s)


def test_prism_extra_layers_go_to_later_stages_and_monotone():
    s = prism(7, 768, 256, 64)
    assert s.heads == (3, 3, 6, 6, 12, 12, 12)
    for n_layers in range(3, 30):
        h = prism(n_layers, 1536, 256, 64).heads
        assert list(h) == sorted(h)


def test_reverse_is_decreasing_and_linear_valid():
    assert reverse(12, 768).heads == (12, 12, 12, 12, 6, 6, 6, 6, 3, 3, 3, 3)
    lin = linear(12, 768, 3, 12)
    assert lin.heads[0] == 3 and lin.heads[-1] == 12
    assert list(lin.heads) == sorted(lin.heads)
    assert all(768 % h == 0 and (768 // h) % 8 == 0 for h in lin.heads)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_uniform_and_prism_have_identical_params_and_flops(preset):
    p = PRESETS[preset]
    kinds = ["uniform", "prism", "reverse", "linear"]
    counts = {k: count_parameters(schedule_from_spec(k, p), p.vocab_size, p.n_positions) for k in kinds}
    flops = {k: flops_per_token(schedule_from_spec(k, p), p.vocab_size, p.n_positions)["total"] for k in kinds}
    assert len({c.total for c in counts.values()}) == 1
    assert len({c.attention for c in counts.values()}) == 1
    assert len(set(flops.values())) == 1


def test_gpt2_124m_parameter_count_matches_hf():
    # GPT-2 small has 124,439,808 parameters (tied head).
    p = PRESETS["gpt2-124m"]
    assert count_parameters(schedule_from_spec("uniform", p), p.vocab_size, p.n_positions).total == 124_439_808


def test_json_round_trip_and_immutability():
    s = prism(12, 768).with_layer(0, LayerSpec(3, 256, 1), neutral=True)
    back = HeadSchedule.from_json(s.to_json())
    assert back == s and back.kv_heads[0] == 1
    with pytest.raises(AttributeError):
        s.d_model = 5  # frozen
    assert json.loads(s.to_json())["layers"][0] == {"n_heads": 3, "head_dim": 256, "n_kv_heads": 1}


@pytest.mark.parametrize(
    "build, values",
    [
        (lambda: HeadSchedule(768, (LayerSpec(12, 64), LayerSpec(0, 64))), ("layer 1", "n_heads", 0)),
        (lambda: HeadSchedule(768, (LayerSpec(12, 64, 5),)), ("layer 0", "n_heads=12", "n_kv_heads=5")),
        (lambda: HeadSchedule(120, (LayerSpec(10, 12),)), ("layer 0", "head_dim=12", 8)),
        (lambda: HeadSchedule(768, (LayerSpec(12, 64), LayerSpec(6, 64))), ("layer 1", 6, 64, 384, "d_model=768")),
        (lambda: from_list("3,6", 768, n_layers=12), (2, 12)),  # 2 entries, 12 layers
        (lambda: from_list("3,5", 768), ("layer 1", "d_model=768", "n_heads=5")),
        (lambda: prism(2, 768), ("prism", "[256, 128, 64]", 2)),  # 3 head dims, 2 layers
        (lambda: schedule_from_spec("spiral", "gpt2-124m"), ("'spiral'",)),
        (lambda: schedule_from_spec("uniform", "gpt9"), ("'gpt9'",)),
    ],
)
def test_validation_errors_name_layer_and_value(build, values):
    with pytest.raises(ScheduleError, match=names(*values)):
        build()


def test_head_dim_multiple_is_overridable_and_budgeted_allowed():
    s = HeadSchedule(120, (LayerSpec(10, 12),), head_dim_multiple=4)
    assert s.head_dims == (12,)
    b = HeadSchedule(768, (LayerSpec(12, 64), LayerSpec(6, 64)), neutral=False)
    assert b.budget == 768 + 384


def test_schedule_from_spec_forms():
    assert schedule_from_spec("uniform@128", "gpt2-124m").heads == (6,) * 12
    assert schedule_from_spec("3,3,3,3,6,6,6,6,12,12,12,12", "gpt2-124m") .heads[4] == 6
    assert schedule_from_spec("prism", "cpu-small").heads == (1, 1, 2, 2, 4, 4)
    assert schedule_from_spec("prism", "gpt2-124m", max_head_dim=128).heads[0] == 6


