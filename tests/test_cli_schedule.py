import json

from conftest import assert_names, error_line
from headbudget.cli.main import main


def test_schedule_table_prism_matches_uniform_totals(capsys):
    assert main(["schedule", "--preset", "gpt2-124m", "--kind", "prism"]) == 0
    prism_out = capsys.readouterr().out
    assert "heads per layer: 3,3,3,3,6,6,6,6,12,12,12,12" in prism_out
    assert main(["schedule", "--preset", "gpt2-124m", "--kind", "uniform"]) == 0
    uniform_out = capsys.readouterr().out
    totals = [line for line in prism_out.splitlines() if line.startswith(("parameters", "forward FLOPs"))]
    assert totals == [line for line in uniform_out.splitlines() if line.startswith(("parameters", "forward FLOPs"))]
    assert "total 124,439,808" in totals[0]


def test_schedule_json_schema(capsys):
    assert main(["schedule", "--preset", "gpt2-124m", "--kind", "prism", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["preset"] == "gpt2-124m" and data["d_model"] == 768
    assert [layer["n_heads"] for layer in data["layers"]] == [3] * 4 + [6] * 4 + [12] * 4
    assert set(data["layers"][0]) == {"n_heads", "head_dim", "n_kv_heads"}
    assert data["params"] == {"total": 124439808, "non_embedding": 85056000, "attention": 28348416}
    assert data["flops_per_token"] == 284812800


def test_schedule_errors_exit_2_with_one_line(capsys):
    assert main(["schedule", "--preset", "gpt9"]) == 2
    assert_names(error_line(capsys.readouterr().err, "schedule"), "gpt9")
    assert main(["schedule", "--preset", "gpt2-124m", "--kind", "3,5,7"]) == 2
    assert_names(error_line(capsys.readouterr().err, "schedule"), 3, 12)  # 3 entries, 12 layers
    assert main(["schedule", "--preset", "gpt2-124m", "--kind", "prism", "--max-head-dim", "96"]) == 2
    assert_names(error_line(capsys.readouterr().err, "schedule"), "max_head_dim", 96)
