"""``HeadBudgetConfig``: a Hugging Face config that fully describes a headbudget decoder.

The head schedule is stored as its JSON dict (``config.schedule``) so ``config.json`` round-trips;
``config.head_schedule`` gives the validated :class:`~headbudget.schedules.HeadSchedule`.

    >>> cfg = HeadBudgetConfig.from_preset("cpu-tiny", schedule="prism", vocab_size=300)
    >>> cfg.head_schedule.heads
    (1, 2, 4, 4)
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from headbudget.schedules import HeadSchedule, get_preset, schedule_from_spec, uniform


class HeadBudgetConfig(PretrainedConfig):
    model_type = "headbudget"
    keys_to_ignore_at_inference = ["cache", "past_key_values"]
    attribute_map = {
        "hidden_size": "n_embd",
        "num_hidden_layers": "n_layer",
        "max_position_embeddings": "n_positions",
    }

    def __init__(
        self,
        schedule: HeadSchedule | dict[str, Any] | None = None,
        vocab_size: int = 50257,
        n_positions: int = 1024,
        dropout: float = 0.0,
        bias: bool = True,
        mlp_ratio: int = 4,
        layer_norm_epsilon: float = 1e-5,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = True,
        use_cache: bool = True,
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        **kwargs: Any,
    ) -> None:
        if schedule is None:
            schedule = uniform(12, 768, 12)
        sched = schedule if isinstance(schedule, HeadSchedule) else HeadSchedule.from_dict(schedule)
        self.schedule = sched.to_dict()
        self.n_embd = sched.d_model
        self.n_layer = sched.n_layers
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.dropout = dropout
        self.bias = bias
        self.mlp_ratio = mlp_ratio
        self.layer_norm_epsilon = layer_norm_epsilon
        self.initializer_range = initializer_range
        self.use_cache = use_cache
        # HF tooling reads a single head count; report the largest layer's (the schedule is the truth).
        self.num_attention_heads = max(sched.heads)
        for derived in ("n_embd", "n_layer", "num_attention_heads", "hidden_size", "num_hidden_layers"):
            kwargs.pop(derived, None)
        super().__init__(
            tie_word_embeddings=tie_word_embeddings,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            **kwargs,
        )

    @property
    def head_schedule(self) -> HeadSchedule:
        return HeadSchedule.from_dict(self.schedule)

    def set_schedule(self, schedule: HeadSchedule) -> None:
        """Replace the schedule (e.g. after pruning); d_model and depth must not change."""
        if schedule.d_model != self.n_embd or schedule.n_layers != self.n_layer:
            raise ValueError(
                f"new schedule is {schedule.n_layers} x {schedule.d_model}, model is {self.n_layer} x {self.n_embd}"
            )
        self.schedule = schedule.to_dict()
        self.num_attention_heads = max(schedule.heads)

    @classmethod
    def from_preset(
        cls, preset: str, schedule: str | HeadSchedule = "uniform", schedule_options: dict | None = None,
        **kwargs: Any
    ) -> HeadBudgetConfig:
        """Config for a named preset (``gpt2-124m``, ``cpu-small``, ...) and schedule kind or object."""
        p = get_preset(preset)
        sched = schedule if isinstance(schedule, HeadSchedule) else schedule_from_spec(
            schedule, p, **(schedule_options or {})
        )
        kwargs.setdefault("vocab_size", p.vocab_size)
        kwargs.setdefault("n_positions", p.n_positions)
        return cls(schedule=sched, **kwargs)
