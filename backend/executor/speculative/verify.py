"""Lossless verification of drafted tokens, batched over rows, with no host synchronisation
(design/dspark.md section 2, "Rule A" and "Rule B"; 1-based i below, 0-based tensor rows).

Inputs per row s (S rows, K drafts, vocabulary V):
  draft_tokens  int [S, K]          x_1..x_K
  draft_probs   fp32 [S, K, V]      Q_i, the exact distribution x_i was drawn from; None for greedy drafts
                                    (one-hot Q: rule "standard" reads Q_i(x_i) = 1 and builds only the one
                                    [S, V] row its residual needs; rule "block" builds them all)
  target_probs  fp32 [S, K+1, V]    T_i after the request's sampling transform: row i-1 is the target's
                                    distribution of the token after x_{i-1} (row 0: after the anchor);
                                    row K is the bonus distribution. One-hot rows for greedy targets.
  uniforms      fp32 [S, K+1]       in [0, 1): u_1..u_K for the acceptance tests, u_{K+1} for the draw of y
  verify_lens   int [S] or None     L <= K drafts to verify per row (None: K)
  vocab_ids     int [N] or None     a reduced draft vocabulary (model/dspark_vocab.py): draft_probs is then
                                    [S, K, N], column j the probability of id vocab_ids[j] (ascending), Q zero
                                    elsewhere; rule "standard" reads Q_i(x_i) at x_i's column and widens one row per
                                    sequence to V for its residual, rule "block" widens Q to [S, K, V]
Output: `num_accepted` n [S] and `tokens` [S, K+1] = x_1..x_n, y, then -1.

Rule "standard" (token-level rejection sampling): accept while u_i < min(1, T_i(x_i) / Q_i(x_i)); at the first
rejection j: y ~ norm(max(0, T_j - Q_j)); all L accepted: y ~ T_{L+1}.
Rule "block" (block verification, Sun et al. 2024): rho_0 = 1, rho_i = min(1, rho_{i-1} T_i(x_i) / Q_i(x_i));
for i < L: Z_i = sum_v max(0, rho_i T_{i+1}(v) - Q_{i+1}(v)), h_i = Z_i / (Z_i + 1 - rho_i) (1 if the
denominator is 0); h_L = rho_L; n = max{i : u_i < h_i} (0 if none); y ~ T_{L+1} if n = L, else
y ~ norm(max(0, rho_n T_{n+1} - Q_{n+1})). The standard rule is the same residual with rho = 1.
The tests compare u_i < h rather than design/dspark.md's u_i <= h: equal in probability for continuous u, and
with u drawn from [0, 1) a probability of exactly 0 can never pass.
A residual whose mass is ~0 (only rounding can make one) falls back to T_{n+1}, as DeepSpec does.
Greedy targets need no branch: with one-hot T the rules accept exactly while x_i = argmax T_i and the
residual is the one-hot argmax, whatever the uniforms. `verify_greedy` computes just that from the argmaxes (the
speculative step takes it when every row is greedy: no vocabulary-wide tensor).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from m3serve.executor.speculative.probs import draw, one_hot
from m3serve.model.dspark_vocab import full_rows, subset_columns

VERIFY_RULES = ("standard", "block")  # vLLM's rejection_sample_method names
_RESIDUAL_FLOOR = 1e-7
_Q_FLOOR = 1e-30


@dataclass
class VerifyOutput:
    num_accepted: torch.Tensor  # int64 [S]: n accepted drafts
    tokens: torch.Tensor  # int64 [S, K+1]: x_1..x_n, y, then -1


def _ratios(draft_tokens, draft_probs, target_probs, vocab_ids=None) -> torch.Tensor:
    """T_i(x_i) / Q_i(x_i), fp32 [S, K] (draft_probs None: one-hot Q, Q_i(x_i) = 1)."""
    k = draft_tokens.shape[1]
    x = draft_tokens.long()[..., None]
    t = target_probs[:, :k].float().gather(2, x)[..., 0]
    if draft_probs is None:
        return t
    if vocab_ids is None:
        q = draft_probs.float().gather(2, x)[..., 0]
    else:
        col, inside = subset_columns(vocab_ids, x)
        q = torch.where(inside, draft_probs.float().gather(2, col), 0.0)[..., 0]
    return t / q.clamp_min(_Q_FLOOR)


def _lengths(verify_lens, s: int, k: int, device) -> torch.Tensor:
    if verify_lens is None:
        return torch.full((s,), k, dtype=torch.long, device=device)
    return verify_lens.long().clamp(0, k)


def _accept_standard(ratio, u, lens) -> tuple[torch.Tensor, torch.Tensor]:
    """(n [S], rho_n [S] = 1)."""
    k = ratio.shape[1]
    active = torch.arange(k, device=ratio.device)[None, :] < lens[:, None]
    ok = (u < ratio.clamp(max=1.0)) & active
    return ok.long().cumprod(-1).sum(-1), torch.ones_like(ratio[:, 0])


def block_acceptance(ratio, lens, draft_probs, target_probs) -> tuple[torch.Tensor, torch.Tensor]:
    """Rule B's h_1..h_K [S, K] (0 past L) and rho_0..rho_K [S, K+1]."""
    k = ratio.shape[1]
    rho = [torch.ones_like(ratio[:, 0])]
    for i in range(k):
        rho.append(torch.minimum(rho[-1] * ratio[:, i], torch.ones_like(rho[-1])))
    rho = torch.stack(rho, 1)  # [S, K+1], rho[:, i] = rho_i
    # Z_i, i = 1..K-1: against T_{i+1} = target row i and Q_{i+1} = draft row i
    z = (rho[:, 1:k, None] * target_probs[:, 1:k].float() - draft_probs[:, 1:k].float()).clamp(min=0).sum(-1)
    den = z + 1.0 - rho[:, 1:k]
    h_mid = torch.where(den > 0, z / torch.where(den > 0, den, 1.0), 1.0)
    idx = torch.arange(1, k + 1, device=ratio.device)[None, :]
    h = torch.cat([h_mid, torch.zeros_like(ratio[:, :1])], 1)
    h = torch.where(idx == lens[:, None], rho[:, 1:], h)
    return torch.where(idx <= lens[:, None], h, 0.0), rho


def _last_passed(ok: torch.Tensor) -> torch.Tensor:
    """n = max{i : test i passed} (1-based; 0 if none) of ok [S, K]."""
    idx = torch.arange(1, ok.shape[1] + 1, device=ok.device)[None, :]
    return torch.where(ok, idx, 0).amax(-1)


def _accept_block(ratio, u, lens, draft_probs, target_probs) -> tuple[torch.Tensor, torch.Tensor]:
    """(n [S], rho_n [S])."""
    h, rho = block_acceptance(ratio, lens, draft_probs, target_probs)
    active = torch.arange(ratio.shape[1], device=ratio.device)[None, :] < lens[:, None]
    n = _last_passed((u < h) & active)
    return n, rho.gather(1, n[:, None])[:, 0]


def verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
           uniforms: torch.Tensor, verify_lens: torch.Tensor | None = None, rule: str = "standard",
           vocab_ids: torch.Tensor | None = None) -> VerifyOutput:
    if rule not in VERIFY_RULES:
        raise ValueError(f"verification rule {rule!r} is not one of {list(VERIFY_RULES)}")
    s, k = draft_tokens.shape
    if draft_probs is None:
        vocab_ids = None  # one-hot Q at the drafted ids
    if draft_probs is None and rule == "block":  # its Z_i reads every Q_{i+1}
        draft_probs = one_hot(draft_tokens, target_probs.shape[2])
    elif vocab_ids is not None and rule == "block":
        draft_probs, vocab_ids = full_rows(draft_probs.float(), vocab_ids, target_probs.shape[2]), None
    q_shape = (s, k) if draft_probs is None else draft_probs.shape[:2]
    if q_shape != (s, k) or target_probs.shape[:2] != (s, k + 1) or uniforms.shape != (s, k + 1):
        raise ValueError(f"verify: shapes disagree: draft_tokens {tuple(draft_tokens.shape)}, draft_probs "
                         f"{None if draft_probs is None else tuple(draft_probs.shape)}, target_probs {tuple(target_probs.shape)}, uniforms "
                         f"{tuple(uniforms.shape)} (want [S,K], [S,K,V], [S,K+1,V], [S,K+1])")
    lens = _lengths(verify_lens, s, k, draft_tokens.device)
    ratio = _ratios(draft_tokens, draft_probs, target_probs, vocab_ids)
    u = uniforms[:, :k].float()
    if rule == "standard":
        n, rho_n = _accept_standard(ratio, u, lens)
    else:
        n, rho_n = _accept_block(ratio, u, lens, draft_probs, target_probs)
    t_next = target_probs.float().gather(1, n[:, None, None].expand(-1, 1, target_probs.shape[2]))[:, 0]
    nq = n.clamp(max=k - 1)[:, None]
    if draft_probs is None:
        q_next = one_hot(draft_tokens.gather(1, nq)[:, 0], target_probs.shape[2])
    else:
        q_next = draft_probs.float().gather(1, nq[..., None].expand(-1, 1, draft_probs.shape[2]))[:, 0]
        if vocab_ids is not None:
            q_next = full_rows(q_next, vocab_ids, target_probs.shape[2])
    residual = (rho_n[:, None] * t_next - q_next).clamp(min=0)
    bonus = (n >= lens) | (residual.sum(-1) <= _RESIDUAL_FLOOR)
    y = draw(torch.where(bonus[:, None], t_next, residual), uniforms[:, k])
    return VerifyOutput(n, _emitted(draft_tokens, n, y))


def verify_greedy(draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
                  verify_lens: torch.Tensor | None = None) -> VerifyOutput:
    """`verify` for greedy targets (one-hot T_i at target_argmax [S, K+1]), without any [S, K+1, V] tensor: either
    rule, with any Q the drafts were drawn from and any uniforms, accepts exactly the leading drafts equal to
    argmax T_i (up to L) and then emits argmax T_{n+1} (ratios 1 or 0, rho_i 1 or 0 so h_i 1 or 0, a residual
    that is either zero, falling back to T, or positive at the argmax alone)."""
    s, k = draft_tokens.shape
    lens = _lengths(verify_lens, s, k, draft_tokens.device)
    active = torch.arange(k, device=draft_tokens.device)[None, :] < lens[:, None]
    n = ((draft_tokens.long() == target_argmax[:, :k]) & active).long().cumprod(-1).sum(-1)
    return VerifyOutput(n, _emitted(draft_tokens, n, target_argmax.gather(1, n[:, None])[:, 0]))


def _emitted(draft_tokens: torch.Tensor, n: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """[S, K+1]: x_1..x_n, y, then -1."""
    col = torch.arange(draft_tokens.shape[1] + 1, device=draft_tokens.device)[None, :]
    end = torch.full((draft_tokens.shape[0], 1), -1, dtype=torch.long, device=draft_tokens.device)  # K = 0 too
    padded = torch.cat([draft_tokens.long(), end], 1)
    tokens = torch.where(col < n[:, None], padded, -1)
    return torch.where(col == n[:, None], y[:, None], tokens)
