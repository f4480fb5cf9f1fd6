"""Helpers for the local copies of lm-eval's tasks (reused from lm-eval where it has them)."""

from lm_eval.tasks.hellaswag.utils import preprocess
from lm_eval.tasks.winogrande.preprocess_winogrande import doc_to_choice, doc_to_target, doc_to_text

__all__ = ["doc_to_choice", "doc_to_target", "doc_to_text", "mmlu_style_choices", "mmlu_style_text",
           "process_hellaswag"]


def process_hellaswag(dataset):
    """lm-eval's hellaswag ``process_docs``; ../shared's copy carries ``ctx`` already cleaned (no
    ``ctx_a``/``ctx_b``), which lm-eval's query reads as ``activity_label: ctx``."""

    def one(doc):
        if "ctx_a" in doc and doc.get("ctx_b") is not None:
            query = preprocess(doc["activity_label"] + ": " + doc["ctx_a"] + " " + doc["ctx_b"].capitalize())
        else:
            query = doc["activity_label"] + ": " + doc["ctx"]
        return {"query": query, "choices": [preprocess(e) for e in doc["endings"]], "gold": int(doc["label"])}

    return dataset.map(one)


LETTERS = "ABCDEFGH"


def mmlu_style_text(doc):
    """MMLU's prompt for an ARC row: the question, lettered options, "Answer:"."""
    options = "".join(f"{LETTERS[i]}. {text}\n" for i, text in enumerate(doc["choices"]["text"]))
    return f"{doc['question'].strip()}\n{options}Answer:"


def mmlu_style_choices(doc):
    """One letter per option (lm-eval adds the target delimiter: " A", " B", ...)."""
    return list(LETTERS[: len(doc["choices"]["text"])])
