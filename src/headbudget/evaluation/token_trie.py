"""Token tries for the scorer: sequences that share leading tokens merged so each shared token runs once.

:func:`trie_layout` lays a trie out depth-first in one row with the positions and subtree ends from
which :class:`headbudget.evaluation.scorer.Scorer` builds its 4-D attention mask; pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all of ``seqs`` share.

        >>> common_prefix_len([[5, 6, 7], [5, 6, 4]])
        2
    """
    n = min(len(s) for s in seqs)
    return next((i for i in range(n) if any(s[i] != seqs[0][i] for s in seqs[1:])), n)


def trie_layout(seqs: Sequence[Sequence[int]]) -> tuple[list[int], list[int], list[int], list[list[int]]]:
    """Token sequences merged into a trie laid out depth-first: (ids, positions (= depths), ends, flat index
    of every position of every sequence).  Token ``b``'s subtree is ``[b, ends[b])``, so token ``a`` may
    attend to ``b`` iff ``b <= a < ends[b]`` (``b`` is ``a`` or an ancestor): every sequence sees exactly
    its own tokens, at its own positions, however many share them.

        >>> trie_layout([[5, 6, 7, 8], [5, 6, 7], [5, 6, 4]])
        ([5, 6, 7, 8, 4], [0, 1, 2, 3, 2], [5, 5, 4, 4, 5], [[0, 1, 2, 3], [0, 1, 2], [0, 1, 4]])
    """
    tokens: list[int] = []
    children: list[dict[int, int]] = []
    roots: dict[int, int] = {}
    paths = []
    for seq in seqs:
        level, path = roots, []
        for t in seq:
            node = level.get(t)
            if node is None:
                node = level[t] = len(tokens)
                tokens.append(t)
                children.append({})
            path.append(node)
            level = children[node]
        paths.append(path)
    flat = [0] * len(tokens)  # node -> index in depth-first order
    ids: list[int] = []
    pos: list[int] = []
    ends: list[int] = []
    stack = [(n, 0) for n in reversed(roots.values())]
    while stack:
        node, depth = stack.pop()
        if node < 0:  # the subtree of ~node is complete
            ends[flat[~node]] = len(ids)
            continue
        flat[node] = len(ids)
        ids.append(tokens[node])
        pos.append(depth)
        ends.append(0)
        stack.append((~node, depth))
        stack.extend((c, depth + 1) for c in reversed(children[node].values()))
    return ids, pos, ends, [[flat[n] for n in path] for path in paths]
