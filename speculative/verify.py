"""Verification of a draft tree against the target's logits — lossless for greedy and for sampling.

Every proposer here drafts deterministically (argmax / top-k / prompt lookup), i.e. the draft distribution of a
proposed child is a point mass. Recursive rejection sampling over the children of a node then reduces to: accept
child c with probability p_res(c), otherwise zero c out of the residual p_res and renormalise; if no child is
accepted the bonus token is drawn from the final residual. Drawing x ~ p once and following the child equal to x
(bonus = x when there is none) realises exactly that procedure, so we do that, with x drawn by the same
counter-based sampler as plain decoding: token j of a request uses noise (seed, j) whether or not it was drafted,
hence a seeded request yields the same tokens with speculation on or off, and greedy is the argmax case.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speculative.tree import DraftTree, node_depths
from workers.kernels.argmax import argmax_logsumexp
from workers.kernels.rng import uniform_noise
from workers.kernels.verdict import tree_verdict
from workers.logits_processing import process_logits
from workers.sampling import SamplingTensors, draw


@dataclass
class Verdict:
    accept_len: torch.Tensor  # [B] accepted draft tokens (0..max_depth)
    path: torch.Tensor  # [B, max_depth + 1] node index on the accepted path (root first; padded with the last)
    out_tokens: torch.Tensor  # [B, max_depth + 1] tokens emitted: out_tokens[:, :accept_len + 1] are valid
    out_logprobs: torch.Tensor  # [B, max_depth + 1] target log-prob of each emitted token


def target_choices(tree: DraftTree, logits: torch.Tensor, sampling: SamplingTensors) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """The token the target emits after each node ([B, D]): argmax, or a sample with counter = output position;
    and the log-normaliser (logsumexp) of each node's raw logits ([B, D], fp32). With logits processing, each node
    chooses from its logits processed as if the drafts on its path had been generated (``process_logits``)."""
    b, d, v = logits.shape
    greedy, lse = argmax_logsumexp(logits.reshape(b * d, v))
    greedy, lse = greedy.view(b, d), lse.view(b, d)
    if sampling.logits_state is not None:
        logits = process_logits(logits, sampling, tree)
        greedy = argmax_logsumexp(logits.reshape(b * d, v))[0].view(b, d)
    if sampling.all_greedy:
        return greedy, lse
    per_node = SamplingTensors(
        temperature=sampling.temperature.repeat_interleave(d), top_k=sampling.top_k.repeat_interleave(d),
        top_p=sampling.top_p.repeat_interleave(d), min_p=sampling.min_p.repeat_interleave(d),
        seeds=sampling.seeds.repeat_interleave(d),
        counters=(sampling.counters.unsqueeze(1) + node_depths(tree)).reshape(-1), kind=sampling.kind,
    )
    drawn = draw(logits.reshape(b * d, v), per_node).view(b, d)
    return torch.where((sampling.temperature <= 0).unsqueeze(1), greedy, drawn), lse


def simulated_acceptance(tree: DraftTree, logits: torch.Tensor, sampling: SamplingTensors, max_depth: int,
                         mean_accept_length: float | torch.Tensor) -> Verdict:
    """BENCHMARK ONLY: accept floor(L - 1 + u) draft tokens of a chain (u uniform, so the mean accept length is L)
    whatever the target says. The emitted tokens are the drafts, not the model's output. L may be a device scalar,
    which a benchmark changes between captured rounds."""
    u = uniform_noise(sampling.seeds, sampling.counters, 1, stream=7).squeeze(1) + (mean_accept_length - 1.0)
    choice, lse = target_choices(tree, logits, sampling)
    return Verdict(*tree_verdict(None, tree.tokens, choice, lse, logits, max_depth, forced=(u, 0.0)))


def verify_tree(tree: DraftTree, logits: torch.Tensor, sampling: SamplingTensors, max_depth: int) -> Verdict:
    """Walk each tree from the root along children equal to the target's choice, and gather what it emits
    (``kernels.verdict.tree_verdict``: one kernel on the GPU). Fixed trip count, no sync."""
    choice, lse = target_choices(tree, logits, sampling)
    return Verdict(*tree_verdict(tree.parents, tree.tokens, choice, lse, logits, max_depth))
