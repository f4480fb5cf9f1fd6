"""headbudget's built-in task files (lm-eval YAML) and the prompts they name."""
