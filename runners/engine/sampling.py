"""Next-token choice for one step: greedy rows by one batched argmax, sampled rows batched through
temperature, min-p, top-k and top-p, then one draw per row from that request's own generator.

Invariants:
- Batch invariance: every operation is row-wise, so a row's token depends only on its logits, its
  parameters and its generator, never on which other requests share the step. That is what makes
  a seed reproduce exactly under continuous batching.
- Greedy is ``argmax`` (the first index on ties), identical for ``temperature == 0`` rows wherever
  they sit in the batch.
- Min-p keeps every token at least ``min_p`` times as likely as the most likely one (after
  temperature); top-k then keeps every survivor whose scaled logit is at least the k-th largest
  of all; top-p then keeps,
  from those renormalised and sorted, the shortest prefix whose mass reaches ``top_p`` (a token
  is kept iff the mass before it is below ``top_p``), widened to every token tied with the last
  one kept. Ties are thus all in or all out and the result does not depend on sort order; the most
  likely token is always kept.
- A row that cannot be sampled fails alone: ``sample`` gives it a reason instead of a token and
  samples the others exactly as without it. Rows fail when the model's logits hold NaN or inf
  (found by one batched check, before anything else sees them; masked tokens are -inf on
  purpose, so the check is of the logits before processing), or when dividing finite logits by
  a tiny temperature overflows, which shows as non-finite probabilities. Nothing else in here
  can fail on finite logits (the filter always keeps at least one token), so a step's sampling
  raises only for a broken device, which no single request can be blamed for.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from runners.engine.params import SamplingParams

__all__ = ["NON_FINITE_LOGITS", "filtered_probs", "sample", "seeded_generator"]

NON_FINITE_LOGITS = "its logits hold NaN or inf (the model produced non-finite values)"


def seeded_generator(seed: int, device: torch.device) -> torch.Generator:
    """A generator of its own for one request, on the device its logits live on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def filtered_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Probabilities ``[n, V]`` after temperature, min-p (``0`` = off), top-k (``0`` = off) and
    top-p (``1`` = off).

    ``temperature``, ``top_p``, ``min_p`` are float ``[n]`` (temperature > 0); ``top_k`` is
    int64 ``[n]``.
    """
    vocab = logits.shape[-1]
    scaled = logits / temperature[:, None]
    ordered = scaled.sort(dim=-1, descending=True).values
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    in_top_k = ordered >= ordered.gather(1, (k - 1)[:, None])
    if min_p is not None:  # p >= min_p * p_max  <=>  logit >= max logit + log(min_p)
        in_top_k &= ordered >= ordered[:, :1] + min_p.log()[:, None]
    probs = ordered.masked_fill(~in_top_k, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    last_kept = (keep.sum(dim=-1, keepdim=True) - 1).clamp(min=0)
    threshold = ordered.gather(1, last_kept)
    return scaled.masked_fill(scaled < threshold, float("-inf")).softmax(dim=-1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    *,
    finite: torch.Tensor | None = None,
) -> list[int | str]:
    """One token per row of ``logits`` ``[n, V]``, or for a row that cannot be sampled the
    reason why (a ``str``); ``generators[i]`` is row i's (None: global). ``finite``: whether
    each row of the model's logits was finite, when ``logits`` were processed (masked) since."""
    if finite is None:
        finite = torch.isfinite(logits).all(dim=-1)
    greedy: list[int] = torch.where(finite, logits.argmax(dim=-1), -1).tolist()
    tokens: list[int | str] = [t if t >= 0 else NON_FINITE_LOGITS for t in greedy]
    rows = [i for i, p in enumerate(params) if not p.greedy and greedy[i] >= 0]
    if not rows:
        return tokens
    device = logits.device
    chosen = [params[i] for i in rows]
    probs = filtered_probs(
        logits[rows].float(),
        torch.tensor([p.temperature for p in chosen], dtype=torch.float32, device=device),
        torch.tensor([p.top_k for p in chosen], dtype=torch.int64, device=device),
        torch.tensor([p.top_p for p in chosen], dtype=torch.float32, device=device),
        torch.tensor([p.min_p for p in chosen], dtype=torch.float32, device=device)
        if any(p.min_p > 0 for p in chosen)
        else None,
    )
    usable: list[bool] = torch.isfinite(probs).all(dim=-1).tolist()
    for j, i in enumerate(rows):
        if usable[j]:
            tokens[i] = int(torch.multinomial(probs[j], 1, generator=generators[i]).item())
        else:
            tokens[i] = (
                f"its logits divided by temperature {params[i].temperature:g} overflow float32 "
                "(non-finite probabilities); use a larger temperature"
            )
    return tokens
