"""Suffix proposer: SuffixDecoding (Oliaro et al., NeurIPS 2025, "SuffixDecoding: Extreme Speculative
Decoding for Emerging AI Applications"), the method of vLLM's ``{"method": "suffix"}``.

Two sources of continuations, each queried as a suffix tree of depth ``max_depth``:

* **the request's own text** (prompt + output so far): every earlier occurrence of a suffix of
  the request's tokens, with what followed it;
* **a global tree over recent outputs**: the outputs of the last ``max_cached_requests`` finished
  requests, inserted as a suffix trie (every suffix, cut at ``max_depth`` tokens) whose nodes count
  how often their path occurred. Agent loops repeat themselves across requests (the same tool
  call, the same file), which the request's own text does not show.

**Speculation** (the paper's sec. 4.2, a single path rather than a tree, since verification here
is one sequence per request): for a match of the request's last ``L`` tokens, from the matched
node repeatedly take the most frequent child, multiplying the path's probability by
``count(child) / count(all children)``; stop when that probability falls below ``min_token_prob``,
at ``max_spec_factor * L`` tokens (a longer match earns a longer draft: speculation of variable
length, more where the tree is confident), at the tree's depth (``max_depth - L``: a path holds the
match and the draft) or at ``k``. The draft's score is the sum of its path probabilities (its
expected number of accepted tokens). Every match length ``L`` up to the longest is a candidate
and the best score wins, as in ArcticInference's ``SuffixTree::speculate``
(``csrc/suffix_decoding/suffix_tree.cc``, the implementation behind vLLM's method): the longest
match alone is not enough, since a long match leaves little depth for the draft (a match of
``max_depth - 1`` tokens while a file is copied would draft a single token). Lengths are tried in
decreasing order of their draft cap (the longer first among equal caps), at most
``MAX_MATCH_LENGTHS`` of them, and the search stops once no cap left can beat the best score, so a
confident copy costs one walk and any query at most four. Of the two sources' drafts the one with
the larger score is proposed.

The request's own "tree" is not built as a trie: a trie over a 2,000-token prompt costs ~50,000
node updates (tens of ms of Python at admission). The same query (occurrences of the matched
suffix, then continuation counts) is answered by a vectorised scan of its token array, which gives
the counts the trie's nodes would hold.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Sequence

import numpy as np

from tinyvllm.spec_decode.ngram_proposer import suffix_matches


MAX_MATCH_LENGTHS = 4  # match lengths tried per query (those with the largest draft caps)


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0


class SuffixTree:
    """A suffix trie of depth ``max_depth`` over several token sequences, with occurrence counts.

    ``insert(tokens)`` adds every suffix of ``tokens`` (each cut at ``max_depth``); ``remove`` takes
    them away again (nodes whose count reaches 0 are deleted). A node's ``count`` is the number of
    occurrences of its path in the inserted sequences.
    """

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = _Node()

    def _update(self, tokens: Sequence[int], delta: int) -> None:
        d = self.max_depth
        n = len(tokens)
        for i in range(n):
            node = self.root
            for t in tokens[i:min(n, i + d)]:
                child = node.children.get(t)
                if child is None:
                    if delta < 0:
                        break
                    child = node.children[t] = _Node()
                child.count += delta
                if child.count <= 0:  # (its subtree's counts are 0 too: it goes with it)
                    del node.children[t]
                    break
                node = child

    def insert(self, tokens: Sequence[int]) -> None:
        self._update(tokens, 1)

    def remove(self, tokens: Sequence[int]) -> None:
        self._update(tokens, -1)

    def match(self, context: Sequence[int]) -> tuple[_Node | None, int]:
        """The node of the longest suffix of ``context`` (at most ``max_depth`` tokens) that is a path
        of the tree and has children, and its length; ``(None, 0)`` if none."""
        n = len(context)
        for p in range(min(self.max_depth, n), 0, -1):
            node = self.root
            for t in context[n - p:]:
                node = node.children.get(t)
                if node is None:
                    break
            if node is not None and node.children:
                return node, p
        return None, 0

    def speculate(self, context: Sequence[int], k: int, max_spec_factor: float,
                  min_token_prob: float) -> tuple[list[int], float]:
        """The best-scoring draft over every matched suffix of ``context``: ``(tokens, score)`` (see the
        module docstring); ``([], 0.0)`` if no suffix matches."""
        _, p = self.match(context)
        best: list[int] = []
        best_score = 0.0
        n = len(context)
        for cap, length in _match_lengths(p, k, max_spec_factor, self.max_depth):
            if cap <= best_score:  # a draft of cap tokens scores at most cap
                break
            node: _Node | None = self.root
            for t in context[n - length:]:
                node = node.children.get(t)  # type: ignore[union-attr]
                if node is None:
                    break
            out: list[int] = []
            prob, score = 1.0, 0.0
            while node is not None and node.children and len(out) < cap:
                total = sum(c.count for c in node.children.values())
                tok, child = max(node.children.items(), key=lambda kv: (kv[1].count, -kv[0]))  # ties: lowest id
                prob *= child.count / total
                if prob < min_token_prob:
                    break
                out.append(tok)
                score += prob
                node = child
            if score > best_score:
                best, best_score = out, score
        return best, best_score


def _match_lengths(p: int, k: int, max_spec_factor: float, max_depth: int) -> list[tuple[int, int]]:
    """``(draft cap, match length)`` for the match lengths ``1..p``, in the order they are tried:
    decreasing cap, then the longer match first (the more specific context)."""
    caps = [(min(k, max(1, math.floor(max_spec_factor * m)), max_depth - m), m) for m in range(p, 0, -1)]
    caps.sort(key=lambda c: -c[0])  # stable: longer first among equal caps
    return caps[:MAX_MATCH_LENGTHS]


def speculate_from_sequence(toks: np.ndarray, max_depth: int, k: int, max_spec_factor: float,
                            min_token_prob: float) -> tuple[list[int], float]:
    """:meth:`SuffixTree.speculate` over the suffix tree of one sequence ``toks`` (int64 array),
    queried with ``toks``'s own end as the context, by scanning instead of building the tree."""
    n = len(toks)
    # every earlier occurrence of the last token, and how far back it matches the end (at most
    # max_depth - 1 tokens: a match of max_depth would leave no room in the tree)
    cand, match = suffix_matches(toks, max_depth - 1)
    if cand.size == 0:
        return [], 0.0
    best: list[int] = []
    best_score = 0.0
    for cap, length in _match_lengths(int(match.max()), k, max_spec_factor, max_depth):
        if cap <= best_score:  # a draft of cap tokens scores at most cap
            break
        occ = cand[match >= length]  # every earlier occurrence of the last `length` tokens
        out: list[int] = []
        prob, score = 1.0, 0.0
        for d in range(cap):
            occ = occ[occ + 1 + d < n]
            if occ.size == 0:
                break
            if occ.size == 1:  # one occurrence left: the rest of the path is its continuation, prob unchanged
                o = int(occ[0])
                rest = toks[o + 1 + d:min(n, o + 1 + cap)].tolist()
                out += rest
                score += prob * len(rest)
                break
            nxt = toks[occ + 1 + d]
            if (nxt == nxt[0]).all():  # every occurrence continues alike: prob unchanged
                tok = int(nxt[0])
            else:
                vals, counts = np.unique(nxt, return_counts=True)
                top = int(np.argmax(counts))  # ties: the lowest token id, as in SuffixTree.speculate
                prob *= float(counts[top]) / nxt.size
                if prob < min_token_prob:
                    break
                tok = int(vals[top])
            out.append(tok)
            score += prob
            occ = occ[nxt == tok]
        if score > best_score:
            best, best_score = out, score
    return best, best_score


class SuffixProposer:
    """SuffixDecoding's proposer: the request's own suffix tree and a global tree over recent outputs.

    Args:
        max_depth: suffix tree depth (tokens), ``suffix_decoding_max_tree_depth``.
        max_cached_requests: finished outputs kept in the global tree (0: no global tree).
        max_spec_factor: at most this many draft tokens per matched token.
        min_token_prob: stop a draft where its path probability falls below this.
    """

    def __init__(self, max_depth: int = 24, max_cached_requests: int = 1000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1) -> None:
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_depth)
        self._cached: OrderedDict[str, list[int]] = OrderedDict()
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}

    def _request_array(self, rid: str, prompt: Sequence[int], output: Sequence[int]) -> np.ndarray:
        arr, n = self._arrays.get(rid, (None, 0))
        m = len(prompt) + len(output)
        if arr is None or m > len(arr):
            grown = np.empty(max(m + 256, 2 * m), dtype=np.int64)
            if arr is None or n == 0:
                grown[:len(prompt)] = prompt
                n = len(prompt)
            else:
                grown[:n] = arr[:n]
            arr = grown
        if m > n:
            arr[n:m] = output[n - len(prompt):]
        self._arrays[rid] = (arr, m)
        return arr[:m]

    def propose(self, rid: str, prompt: Sequence[int], output: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens for request ``rid`` (its prompt and output so far)."""
        toks = self._request_array(rid, prompt, output)
        own, own_score = speculate_from_sequence(toks, self.max_depth, k, self.max_spec_factor, self.min_token_prob)
        if self.max_cached_requests and self.global_tree.root.children:
            ctx = toks[-self.max_depth:].tolist()
            glob, glob_score = self.global_tree.speculate(ctx, k, self.max_spec_factor, self.min_token_prob)
            if glob_score > own_score:
                return glob
        return own

    def finish(self, rid: str, output: Sequence[int]) -> None:
        """Request ``rid`` finished with ``output``: drop its state, add the output to the global tree
        (dropping the oldest cached output past ``max_cached_requests``)."""
        self._arrays.pop(rid, None)
        if not self.max_cached_requests or not output:
            return
        out = list(output)
        self.global_tree.insert(out)
        self._cached[rid] = out
        while len(self._cached) > self.max_cached_requests:
            _, old = self._cached.popitem(last=False)
            self.global_tree.remove(old)

    def prune(self, live: set[str]) -> None:
        """Drop the state of requests not in ``live`` (aborted ones) once it outgrows them."""
        if len(self._arrays) > 2 * len(live) + 16:
            self._arrays = {k: v for k, v in self._arrays.items() if k in live}
