"""The built-in synthetic corpus: a small generated language with hierarchical structure.

Deterministic from a seed, any size, no download.  A probabilistic context-free grammar with depth-damped
recursion gives a model three kinds of dependency at three distances: local agreement (determiner/noun,
irregular plurals), subject-verb agreement across nested relative clauses, and long-range matching (typed
``<k ... k>`` markers closed last-opened-first-closed, and ``= end NAME =`` copying the document's opening
name).  Grammar and measurements: docs/training.md.

    >>> from headbudget.data.synthetic import generate_documents
    >>> docs = generate_documents(200, seed=0)
    >>> docs == generate_documents(200, seed=0), docs[0].split()[0]
    (True, '=')
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

#: Bumped whenever the grammar changes, so cached prepared data is not reused across versions.
GRAMMAR_VERSION = 1

NOUNS: tuple[tuple[str, str], ...] = (
    ("dog", "dogs"), ("cat", "cats"), ("bird", "birds"), ("horse", "horses"), ("fox", "foxes"),
    ("farmer", "farmers"), ("king", "kings"), ("queen", "queens"), ("teacher", "teachers"),
    ("robot", "robots"), ("sailor", "sailors"), ("wolf", "wolves"), ("child", "children"),
    ("mouse", "mice"), ("man", "men"), ("woman", "women"), ("goose", "geese"), ("baker", "bakers"),
    ("pilot", "pilots"), ("doctor", "doctors"),
)
OBJECT_NOUNS: tuple[tuple[str, str], ...] = (
    ("apple", "apples"), ("song", "songs"), ("letter", "letters"), ("river", "rivers"),
    ("stone", "stones"), ("map", "maps"), ("box", "boxes"), ("story", "stories"),
)
ADJECTIVES: tuple[str, ...] = (
    "old", "young", "small", "big", "red", "green", "quiet", "loud", "happy", "tired", "clever", "brave",
)
# (singular, plural) verb forms
INTRANSITIVE: tuple[tuple[str, str], ...] = (
    ("sleeps", "sleep"), ("runs", "run"), ("sings", "sing"), ("waits", "wait"), ("laughs", "laugh"),
    ("falls", "fall"), ("swims", "swim"), ("dances", "dance"),
)
TRANSITIVE: tuple[tuple[str, str], ...] = (
    ("sees", "see"), ("chases", "chase"), ("likes", "like"), ("helps", "help"), ("finds", "find"),
    ("follows", "follow"), ("watches", "watch"), ("carries", "carry"),
)
SAYING: tuple[tuple[str, str], ...] = (
    ("says", "say"), ("thinks", "think"), ("knows", "know"), ("hopes", "hope"),
)
DET_SING: tuple[str, ...] = ("the", "a", "every", "this")
DET_PLUR: tuple[str, ...] = ("the", "some", "many", "these")
NAMES: tuple[str, ...] = (
    "alice", "bruno", "chloe", "dmitri", "elena", "farid", "greta", "hiro", "ines", "jonas", "kofi", "lena",
    "marco", "nadia", "oscar", "priya", "quinn", "rosa", "sami", "tomas", "ulla", "victor", "wen", "yara",
)
MARKERS: tuple[str, ...] = ("a", "b", "c", "d", "e", "f", "g", "h")

MAX_DEPTH = 4


class _Gen:
    """One generator: a numpy Generator plus the grammar's productions (words appended to ``out``)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng
        self.out: list[str] = []

    def p(self, prob: float) -> bool:
        return bool(self.rng.random() < prob)

    def pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))]

    # NP -> Det Adj* Noun [RelClause]   (number chosen by the caller)
    def noun_phrase(self, plural: bool, depth: int, nouns=NOUNS, allow_rel: bool = True) -> None:
        self.out.append(self.pick(DET_PLUR if plural else DET_SING))
        for _ in range(int(self.rng.choice(3, p=(0.6, 0.3, 0.1)))):
            self.out.append(self.pick(ADJECTIVES))
        self.out.append(self.pick(nouns)[1 if plural else 0])
        if allow_rel and depth < MAX_DEPTH and self.p(0.35 / (1 + depth)):
            self.relative_clause(plural, depth + 1)

    def relative_clause(self, head_plural: bool, depth: int) -> None:
        self.out.append("that")
        if self.p(0.5):
            # subject relative: "that chase the cat" - the verb agrees with the head noun
            self.out.append(self.pick(TRANSITIVE)[1 if head_plural else 0])
            self.noun_phrase(self.p(0.5), depth, nouns=OBJECT_NOUNS + NOUNS, allow_rel=False)
        else:
            # object relative: "that the cat chases" - the verb agrees with the inner subject
            inner_plural = self.p(0.5)
            self.noun_phrase(inner_plural, depth, allow_rel=False)
            self.out.append(self.pick(TRANSITIVE)[1 if inner_plural else 0])

    # VP -> Vi | Vt NP | Vs that S   (agreeing with the subject's number)
    def verb_phrase(self, plural: bool, depth: int, name: str) -> None:
        r, k = self.rng.random(), 1 if plural else 0
        if r < 0.35:
            self.out.append(self.pick(INTRANSITIVE)[k])
        elif r < 0.8 or depth >= MAX_DEPTH:
            self.out.append(self.pick(TRANSITIVE)[k])
            self.noun_phrase(self.p(0.5), depth + 1, nouns=OBJECT_NOUNS + NOUNS)
        else:
            self.out += [self.pick(SAYING)[k], "that"]
            self.clause(depth + 1, name)

    # S -> [<k] Subject VP [k>] [and S]
    def clause(self, depth: int, name: str, open_markers: list[str] | None = None) -> None:
        stack = open_markers if open_markers is not None else []
        marker = None
        if depth < MAX_DEPTH and self.p(0.3):
            marker = self.pick(MARKERS)
            self.out.append("<" + marker)
            stack.append(marker)
        if self.p(0.2):
            self.out.append(name)  # the document's protagonist: singular
            plural = False
        else:
            plural = self.p(0.5)
            self.noun_phrase(plural, depth)
        self.verb_phrase(plural, depth, name)
        if marker is not None:
            self.out.append(stack.pop() + ">")
        if depth < MAX_DEPTH and self.p(0.15 / (1 + depth)):
            self.out.append("and")
            self.clause(depth + 1, name, stack)

    def document(self, n_sentences: int) -> str:
        name = self.pick(NAMES)
        self.out = ["=", name, "="]
        for _ in range(n_sentences):
            self.clause(0, name)
            self.out.append(".")
        self.out += ["=", "end", name, "="]
        return " ".join(self.out)


def iter_documents(n_words: int, seed: int = 0) -> Iterator[str]:
    """Yield documents until at least ``n_words`` whitespace-separated words have been produced."""
    if n_words <= 0:
        raise ValueError(f"synthetic corpus size must be a positive number of words, got {n_words}")
    gen = _Gen(np.random.default_rng([GRAMMAR_VERSION, seed]))
    total = 0
    while total < n_words:
        doc = gen.document(int(gen.rng.integers(3, 9)))
        total += doc.count(" ") + 1
        yield doc


def generate_documents(n_words: int, seed: int = 0) -> list[str]:
    """All documents of a corpus of about ``n_words`` words (the last document completes).

    >>> len(" ".join(generate_documents(1000, seed=3)).split()) >= 1000
    True
    """
    return list(iter_documents(n_words, seed))


def generate_text(n_words: int, seed: int = 0, separator: str = "\n") -> str:
    """The corpus as one string, documents separated by ``separator``."""
    return separator.join(iter_documents(n_words, seed))
