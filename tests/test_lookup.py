"""The context lookup (layers/tree.py ContextLookup) that fills a draft tree's lookup branch: its answer against a
brute-force search of the whole context, as the context grows (DFlash2 with the branch: tests/test_tree.py,
tests/test_sampling.py)."""

import random

import pytest

from blockspec.layers.tree import LONGEST, ContextLookup


def brute_force(context: list[int], root: int, width: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix (up to LONGEST tokens) of context + [root]
    that occurred before it ended, repeating with the distance between the two past the root."""
    text = context + [root]
    for n in range(min(LONGEST, len(text) - 1), 0, -1):
        starts = [s for s in range(len(text) - n) if text[s:s + n] == text[len(text) - n:]]
        if starts:
            after = starts[-1] + n
            return [text[after + i % (len(text) - after)] for i in range(width)]
    return []


@pytest.mark.parametrize("vocab", [2, 5, 40])
def test_lookup_is_the_latest_longest_match(vocab):
    rng = random.Random(vocab)
    context = [rng.randrange(vocab) for _ in range(rng.randrange(0, 5))]
    lookup = ContextLookup(context)
    found = longest = 0
    for _ in range(520):
        root, width = rng.randrange(vocab + 1), rng.randrange(1, 9)
        want = brute_force(context, root, width)
        assert lookup.branch(root, width) == want, (context, root, width)
        found += bool(want)
        added = [rng.randrange(vocab) for _ in range(rng.randrange(1, 5))]
        context += added
        lookup.extend(added)  # grows past its first buffer (1024 ids)
        longest = max(longest, len(context))
    assert found > 100 and longest > 1024
    assert ContextLookup([]).branch(3, 4) == [] and ContextLookup([3]).branch(3, 4) == [3, 3, 3, 3]
    assert ContextLookup([5, 1, 2, 5, 1, 2, 7, 1]).branch(2, 5) == [7, 1, 2, 7, 1]  # ...1 2 | 7 1 2 7 1: a loop
    assert ContextLookup([1, 2, 3, 1, 2]).branch(3, 7) == [1, 2, 3, 1, 2, 3, 1]
