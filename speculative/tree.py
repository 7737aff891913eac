"""Draft trees: the EAGLE-2 dynamic tree built from per-step top-k expansions, and its verify-time tensors.

All functions are batched over requests and run on the device with fixed shapes (no host sync), so a whole draft
round can be captured in a CUDA graph.

Node 0 of every tree is the root: the last verified token, whose K/V the target has not computed yet. Nodes
1..D-1 are drafted tokens; ``parents[b, i] < i`` (parents come first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [B, D] int64, node 0 = root
    # A chain (root → d1 → d2 ...) has None for these three: node i's parent is i - 1, its depth i, and its nodes
    # sit at consecutive positions in order, so its mask is the plain causal one.
    parents: torch.Tensor | None  # [B, D] int64, -1 for the root
    depths: torch.Tensor | None  # [B, D] int64, root depth 0
    mask: torch.Tensor | None  # [B, D, D] bool, row i sees node j iff j is i or an ancestor of i

    @property
    def is_chain(self) -> bool:
        return self.parents is None

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[1])


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, N, N] bool: self plus every ancestor, following ``parents`` (−1 = none) up to max_depth hops.
    Scatter-only (no boolean indexing), so it never waits for the device."""
    b, n = parents.shape
    mask = torch.eye(n, dtype=torch.bool, device=parents.device).expand(b, n, n).clone()
    anc = parents
    for _ in range(max_depth):
        valid = anc >= 0
        mask |= torch.zeros_like(mask).scatter_(2, anc.clamp(min=0).unsqueeze(2), valid.unsqueeze(2))
        anc = torch.where(valid, parents.gather(1, anc.clamp(min=0)), anc)
    return mask


def chain_tree(root: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """A chain root → d1 → d2 ... (drafts [B, S])."""
    return DraftTree(torch.cat([root.unsqueeze(1), drafts], dim=1), None, None, None)


def node_depths(tree: DraftTree) -> torch.Tensor:
    """[B, D] int64 depth of every node (a chain's are 0 .. D-1)."""
    if tree.depths is not None:
        return tree.depths
    b, d = tree.tokens.shape
    return torch.arange(d, device=tree.tokens.device).expand(b, d)


class TreeCandidates:
    """Bookkeeping of the EAGLE-2 expansion: every expanded child is a candidate with a cumulative log-prob score.

    Step 1 adds the root's top-k children. Every later step expands the current frontier (the best k candidates
    of the previous step) by top-k each and keeps the best k of the k*k children as the next frontier.
    """

    def __init__(self, batch: int, topk: int, num_steps: int, device, chain: bool = False):
        self.k = topk
        self.chain = chain  # top-1 drafting without the tree bookkeeping (see ``_ModelProposer.chain``)
        if chain and topk != 1:
            raise ValueError("a chain drafts top-1")
        cap = topk + (num_steps - 1) * topk * topk
        if chain:  # a chain (top-1) is its tokens in order, each written before it is read: no scores, parents or
            # depths to keep; stored depth-major ([depth, B]) so that each step's argmax writes its row in place
            self.tokens = torch.empty(cap, batch, dtype=torch.int64, device=device)
        else:
            self.tokens = torch.zeros(batch, cap, dtype=torch.int64, device=device)
            self.scores = torch.full((batch, cap), float("-inf"), device=device)
            self.parents = torch.full((batch, cap), -1, dtype=torch.int64, device=device)  # candidate, -1 = root
            self.depths = torch.zeros(batch, cap, dtype=torch.int64, device=device)
        self.used = 0
        self.frontier = None  # [B, k] candidate indices
        self.frontier_scores = None

    def next_chain_node(self) -> torch.Tensor:
        """A chain's next node ([B] int64, contiguous): whoever computes it (a state gather, a step's argmax) writes
        it here in place; ``add_root_children`` / ``expand`` then take this very tensor (no copy kernel)."""
        return self.tokens[self.used]

    def _count_chain_node(self, tokens: torch.Tensor) -> None:
        if tokens.data_ptr() != self.tokens[self.used].data_ptr():
            raise ValueError("a chain's node is written in place into next_chain_node()")
        self.used += 1

    def add_root_children(self, tokens: torch.Tensor, logp: torch.Tensor | None) -> None:
        """The root's k best children ([B, k]) and their log-probs (a chain: ``next_chain_node()``, None)."""
        if self.chain:
            return self._count_chain_node(tokens)
        k = self.k
        self.tokens[:, :k] = tokens
        self.used = k
        self.frontier = torch.arange(k, device=tokens.device).expand(tokens.shape[0], k)
        self.scores[:, :k] = logp
        self.depths[:, :k] = 1
        self.frontier_scores = logp

    def expand(self, child_tokens: torch.Tensor, child_logp: torch.Tensor) -> torch.Tensor:
        """child_tokens/logp: [B, k(frontier), k(children)]. Returns, per new frontier slot, which old frontier
        slot it descends from ([B, k]) — the caller carries that parent's hidden state forward; None for a chain,
        whose one child descends from the only slot."""
        if self.chain:  # the one child (written in place) is the next frontier
            self._count_chain_node(child_tokens)
            return None
        b, k = self.frontier.shape
        cum = (self.frontier_scores.unsqueeze(2) + child_logp).reshape(b, k * k)
        start, end = self.used, self.used + k * k
        self.tokens[:, start:end] = child_tokens.reshape(b, k * k)
        self.scores[:, start:end] = cum
        self.parents[:, start:end] = self.frontier.repeat_interleave(k, dim=1)
        self.depths[:, start:end] = self.depths.gather(1, self.frontier).repeat_interleave(k, dim=1) + 1
        self.used = end
        best_scores, best = cum.topk(k, dim=1)
        self.frontier = best + start
        self.frontier_scores = best_scores
        return best // k

    def build(self, root: torch.Tensor, num_nodes: int, max_depth: int) -> DraftTree:
        """Keep the ``num_nodes - 1`` best candidates (scores fall along every path, so the set is closed under
        parents; ties are broken towards shallower nodes) and return the verify tree."""
        b = root.shape[0]
        n = num_nodes - 1
        used = self.used
        if self.chain:  # scores fall along it, so the best n are its first n
            return chain_tree(root, self.tokens[:n].t())
        # shallower first on ties: subtract a tiny depth penalty
        key = self.scores[:, :used] - self.depths[:, :used].float() * 1e-6
        chosen = key.topk(n, dim=1).indices.sort(dim=1).values  # candidate order = parents before children
        remap = torch.full((b, used), -1, dtype=torch.int64, device=root.device)
        remap.scatter_(1, chosen, torch.arange(1, n + 1, device=root.device).expand(b, n))
        cand_parent = self.parents[:, :used].gather(1, chosen)
        node_parent = torch.where(cand_parent >= 0, remap.gather(1, cand_parent.clamp(min=0)), torch.zeros_like(cand_parent))
        tokens = torch.cat([root.unsqueeze(1), self.tokens[:, :used].gather(1, chosen)], dim=1)
        parents = torch.cat([torch.full((b, 1), -1, dtype=torch.int64, device=root.device), node_parent], dim=1)
        depths = torch.cat([torch.zeros(b, 1, dtype=torch.int64, device=root.device),
                            self.depths[:, :used].gather(1, chosen)], dim=1)
        return DraftTree(tokens, parents, depths, ancestor_mask(parents, max_depth))
