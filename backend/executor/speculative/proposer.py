"""The DSpark proposal (the draft half of a speculative step), batched over S sequences as tensor functions
(design/dspark.md section 2):

1. `insert_context`: the pending context rows (tapped target features of newly committed positions) become
   K/V rows in the draft cache, written at the target's slots (-1 = skip the row).
2. one backbone pass over [anchor, mask x (gamma-1)] per sequence, reading the cache through the target's
   block tables -> block hidden h [S, gamma, H] -> base logits U_k = lm_head(h_k) for the first K slots;
3. `sample_block`: K cheap draft positions, one after the other: z_k = U_k + B_k(x_{k-1}), Q_k = the request's
   transform of z_k (`probabilistic`) or one-hot argmax (`greedy`), x_k drawn from exactly Q_k, confidence c_k
   from [h_k ; W1[x_{k-1}]].
With a reduced draft vocabulary (model/dspark_vocab.py) U, the Markov bias and Q cover its N ids only (columns in
ascending id order): a draft is drawn as a column and handed on as its vocabulary id (`Proposal.vocab_ids` says
which id each column of Q is; the verifier treats Q as zero elsewhere).
Randomness comes in from the caller (uniforms [S, K], or a callable), nothing syncs with the host.
Greedy drafts of a vanilla Markov head on CUDA, with no logits kept, take the fused kernels (kernels/markov.py: two
launches per position instead of about six; `fused_markov` says when; M3SERVE_MARKOV_KERNEL=0 keeps the torch loop),
the confidence head then batched over the K positions after them; the loop below is their reference.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from m3serve.executor.speculative.draft_cache import DraftKVCache
from m3serve.executor.speculative.probs import draw, sampling_probs
from m3serve.kernels import platform
from m3serve.kernels.markov import markov_greedy
from m3serve.step_io import SamplingInput
from m3serve.model.dspark import DSparkDraft
from m3serve.model.dspark_heads import ConfidenceHead, MarkovHead

DRAFT_SAMPLE_METHODS = ("probabilistic", "greedy")  # vLLM's draft_sample_method names
# uniforms [S, K] in [0, 1), or (k, Q_k [S, V]) -> tokens [S]: the engine's per-request RNG
Draws = torch.Tensor | Callable[[int, torch.Tensor], torch.Tensor]


@dataclass
class Proposal:
    tokens: torch.Tensor  # int64 [S, K]: x_1..x_K (vocabulary ids)
    probs: torch.Tensor | None  # fp32 [S, K, V or N]: Q_k each x_k was drawn from; None for greedy (one-hot)
    confidence: torch.Tensor  # fp32 [S, K]: c_k in (0, 1); ones without a confidence head
    logits: torch.Tensor | None  # fp32 [S, K, V or N]: z_k = U_k + B_k(x_{k-1}) before the sampling transform
    # (None: not kept, as in the engine's step)
    vocab_ids: torch.Tensor | None = None  # int64 [N] ascending: the vocabulary id of each column of probs / logits
    # (a reduced draft vocabulary); None: the columns are the vocabulary


def fused_markov(markov_head: MarkovHead | None, method: str, keep_logits: bool, device: torch.device) -> bool:
    """Whether `sample_block` takes the fused greedy kernels: CUDA, greedy drafts, a vanilla Markov head, no logits
    kept (the other head types, sampled drafts and the CPU run the loop), where `platform.markov_kernel_ok` (not
    with M3SERVE_MARKOV_KERNEL=0)."""
    return (method == "greedy" and markov_head is not None and markov_head.kind == "vanilla" and not keep_logits
            and platform.markov_kernel_ok(device))


@torch.inference_mode()
def sample_block(markov_head: MarkovHead | None, confidence_head: ConfidenceHead | None, h: torch.Tensor,
                 base_logits: torch.Tensor, anchor_ids: torch.Tensor, method: str = "probabilistic",
                 sampling: SamplingInput | None = None, draws: Draws | None = None, keep_logits: bool = True,
                 vocab_ids: torch.Tensor | None = None) -> Proposal:
    """The sequential Markov loop over K slots: h [S, K, H], base_logits U fp32 [S, K, V], anchors [S].
    keep_logits=False: `Proposal.logits` is None (the engine's step: no [S, K, V] copy). vocab_ids [N]: U and the
    Markov bias are over a draft vocabulary's columns (the draft's `vocab_ids`); draws (a callable's too) are
    columns."""
    if method not in DRAFT_SAMPLE_METHODS:
        raise ValueError(f"draft_sample_method {method!r} is not one of {list(DRAFT_SAMPLE_METHODS)}")
    if method == "probabilistic" and draws is None:
        raise ValueError("probabilistic draft sampling needs draws (uniforms [S, K] or a callable)")
    s, k, _ = base_logits.shape
    if fused_markov(markov_head, method, keep_logits, base_logits.device):
        tokens = markov_greedy(markov_head.markov_w1.weight, markov_head.markov_w2.weight, base_logits, anchor_ids,
                               vocab_ids)
        conf = torch.ones(s, k, device=base_logits.device)
        if confidence_head is not None:  # c_k reads W1[x_{k-1}]: the anchor, then the drafts
            prev = torch.cat([anchor_ids.long()[:, None], tokens[:, :-1]], 1)
            conf = confidence_head(h, markov_head.prev_embedding(prev))
        return Proposal(tokens, None, conf, None, vocab_ids)
    prev = anchor_ids.long()
    state = markov_head.init_state(h[:, 0]) if markov_head is not None else None
    tokens, probs, conf, logits = [], [], [], []
    for i in range(k):
        z, e = base_logits[:, i], None
        if markov_head is not None:
            bias, e, state = markov_head.position(h[:, i], prev, state)
            z = z + bias
        if confidence_head is not None:
            conf.append(confidence_head(h[:, i], e))
        if method == "greedy":
            x = z.argmax(-1)
        else:
            q = sampling_probs(z, sampling)
            x = draws(i, q) if callable(draws) else draw(q, draws[:, i])
            probs.append(q)
        if vocab_ids is not None:
            x = vocab_ids[x]
        tokens.append(x)
        if keep_logits:
            logits.append(z)
        prev = x
    confidence = torch.stack(conf, 1) if conf else torch.ones(s, k, device=base_logits.device)
    return Proposal(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None, confidence,
                    torch.stack(logits, 1) if keep_logits else None, vocab_ids)


@torch.inference_mode()
def insert_context(draft: DSparkDraft, cache: DraftKVCache, features: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor) -> None:
    """Write the K/V rows of N committed positions: features [N, m*H] (the draft's tapped layers,
    concatenated in order), positions [N], slots [N] (the target's slot mapping; -1 = skip)."""
    cache.write_rows(draft.context_kv(features, positions), slots)


@torch.inference_mode()
def propose(draft: DSparkDraft, cache: DraftKVCache, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor,
            block_tables: torch.Tensor, num_tokens: int, method: str = "probabilistic",
            sampling: SamplingInput | None = None, draws: Draws | None = None,
            pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> Proposal:
    """One proposal (K drafts each) for S sequences.

    anchor_ids [S]: x0, the last token the target produced; anchor_positions [S]: its position t (every
    position < t must be in the cache once `pending` is inserted); block_tables int [S, max_pages]: the
    target's; num_tokens K <= gamma; pending: (features, positions, slots) rows to insert first."""
    if not 1 <= num_tokens <= draft.block_size:
        raise ValueError(f"num_speculative_tokens {num_tokens} must be in 1..{draft.block_size} (the draft's "
                         "block_size)")
    if pending is not None:
        insert_context(draft, cache, *pending)
    h = draft.block_hidden(anchor_ids, anchor_positions, cache.context_fn(block_tables))[:, :num_tokens]
    return sample_block(draft.markov_head, draft.confidence_head, h, draft.base_logits(h), anchor_ids, method,
                        sampling, draws, vocab_ids=draft.vocab_ids)
