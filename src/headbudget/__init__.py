"""headbudget: adaptive head budgeting for Transformers.

    >>> import headbudget
    >>> from headbudget.schedules import prism
    >>> prism(12, 768).heads[:4]
    (3, 3, 3, 3)

Importing the package registers the ``headbudget`` model type with ``AutoConfig`` and
``AutoModelForCausalLM``, so saved models load with ``AutoModelForCausalLM.from_pretrained(dir)``.
"""

__version__ = "0.1.0"


def _register() -> None:
    try:
        from headbudget.models import register_auto_classes
    except ImportError:  # torch/transformers missing: schedules and accounting still work
        return
    register_auto_classes()
    import headbudget.evaluation  # noqa: F401  (registers the lm-eval model "headbudget" when installed)


_register()
