"""The scorer's token trie, in its own module (split out of scorer.py at the trie)."""

from headbudget.evaluation.scorer import Scorer
from headbudget.evaluation.token_trie import common_prefix_len, trie_layout


def test_trie_layout_values_and_the_scorer_alias():
    assert trie_layout([[5, 6, 7, 8], [5, 6, 7], [5, 6, 4], [9]]) == (
        [5, 6, 7, 8, 4, 9], [0, 1, 2, 3, 2, 0], [5, 5, 4, 4, 5, 6], [[0, 1, 2, 3], [0, 1, 2], [0, 1, 4], [5]])
    assert Scorer._layout is trie_layout
    assert [common_prefix_len(s) for s in ([[1, 2, 3], [1, 2, 4]], [[1], [1, 2]], [[3], [4]])] == [2, 1, 0]
