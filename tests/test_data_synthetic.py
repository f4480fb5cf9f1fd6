"""The built-in synthetic corpus: deterministic, sized, and grammatical by construction."""

from __future__ import annotations

import re

from headbudget.data import synthetic
from headbudget.data.synthetic import generate_documents, generate_text

SING_VERBS = {s for s, _ in synthetic.INTRANSITIVE + synthetic.TRANSITIVE + synthetic.SAYING}
PLUR_VERBS = {p for _, p in synthetic.INTRANSITIVE + synthetic.TRANSITIVE + synthetic.SAYING}
SING_NOUNS = {s for s, _ in synthetic.NOUNS + synthetic.OBJECT_NOUNS}
PLUR_NOUNS = {p for _, p in synthetic.NOUNS + synthetic.OBJECT_NOUNS}


def test_deterministic_and_seed_dependent():
    a = generate_documents(3000, seed=7)
    assert a == generate_documents(3000, seed=7)
    assert a != generate_documents(3000, seed=8)
    assert generate_text(3000, seed=7) == "\n".join(a)


def test_size_is_at_least_requested_words_and_only_one_document_over():
    for n in (50, 5000):
        docs = generate_documents(n, seed=1)
        words = [len(d.split()) for d in docs]
        assert sum(words) >= n
        assert sum(words[:-1]) < n  # generation stops as soon as the size is reached


def test_documents_open_and_close_with_the_same_name():
    for doc in generate_documents(5000, seed=2):
        w = doc.split()
        assert w[0] == "=" and w[2] == "=" and w[1] in synthetic.NAMES
        assert w[-4:] == ["=", "end", w[1], "="]


def test_markers_are_balanced_and_nested_last_in_first_out():
    nested = 0
    for doc in generate_documents(20000, seed=3):
        stack: list[str] = []
        for w in doc.split():
            if re.fullmatch(r"<[a-h]", w):
                stack.append(w[1])
                nested = max(nested, len(stack))
            elif re.fullmatch(r"[a-h]>", w):
                assert stack and stack.pop() == w[0], doc
            elif w == ".":
                assert not stack, doc  # markers never cross sentence boundaries
        assert not stack
    assert nested >= 2  # the corpus does contain nested markers


def test_local_determiner_noun_agreement():
    checked = 0
    for doc in generate_documents(5000, seed=4):
        w = doc.split()
        for i, word in enumerate(w[:-1]):
            if word in ("a", "every", "this"):
                # skip adjectives to the noun
                j = i + 1
                while w[j] in synthetic.ADJECTIVES:
                    j += 1
                assert w[j] in SING_NOUNS, (doc, word, w[j])
                checked += 1
            elif word in ("some", "many", "these"):
                j = i + 1
                while w[j] in synthetic.ADJECTIVES:
                    j += 1
                assert w[j] in PLUR_NOUNS, (doc, word, w[j])
                checked += 1
    assert checked > 500


def test_subject_verb_agreement_across_a_relative_clause():
    """`the N that ... V` at sentence start: the main verb agrees with N across the clause."""
    gen = synthetic._Gen(__import__("numpy").random.default_rng(0))
    found = 0
    for _ in range(400):
        gen.out = []
        plural = bool(gen.rng.random() < 0.5)
        gen.noun_phrase(plural, depth=0)
        if "that" not in gen.out:
            continue
        gen.verb_phrase(plural, depth=0, name="alice")
        np_len = gen.out.index("that")
        main_verb = gen.out[_np_end(gen.out, np_len)]  # verb_phrase's first word follows the NP
        assert main_verb in (PLUR_VERBS if plural else SING_VERBS), gen.out
        found += 1
    assert found > 50


def _np_end(words: list[str], that_index: int) -> int:
    """Index just after the relative clause that starts at ``that_index`` (subject or object relative)."""
    i = that_index + 1
    if words[i] in SING_VERBS | PLUR_VERBS:  # subject relative: V Det Adj* N
        i += 2
        while words[i] in synthetic.ADJECTIVES:
            i += 1
        return i + 1
    i += 1  # object relative: Det Adj* N V
    while words[i] in synthetic.ADJECTIVES:
        i += 1
    return i + 2
