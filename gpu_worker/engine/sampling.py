"""Choosing the next token from logits, on the device that computed them.

Temperature 0 is greedy (argmax). Otherwise the logits are divided by the temperature, the
smallest set of most likely tokens whose probability reaches top_p is kept (nucleus), and a token is
drawn by the exponential race: argmax(p / E) with E ~ Exp(1) per token picks token i with
probability p_i. The race needs one noise tensor per row rather than a multinomial call, and each
row draws its noise from its own request's generator, so a request seeded the same way samples the
same tokens whichever other requests share its batch.
"""

from __future__ import annotations

import torch


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero every token outside each row's nucleus; the most likely token always stays."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def penalize(logits: torch.Tensor, rows: list[tuple[int, list[int], float, float]]) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: for each (row, tokens generated so far, presence,
    frequency), the logit of token j loses `frequency * count(j) + presence * (count(j) > 0)`.
    Returns a penalized copy (the forward's output may be a static CUDA-graph buffer)."""
    logits = logits.float().clone()
    for row, generated, presence, frequency in rows:
        if not generated:
            continue
        ids, counts = torch.unique(torch.tensor(generated, device=logits.device), return_counts=True)
        logits[row, ids] -= frequency * counts.float() + presence
    return logits


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token id per row of `logits` `[n, vocab]`; rows with temperature 0 take the argmax."""
    tokens = logits.argmax(dim=-1)
    rows = [i for i, t in enumerate(temperatures) if t > 0]
    if rows:
        device = logits.device
        index = torch.tensor(rows, device=device)
        temperature = torch.tensor([temperatures[i] for i in rows], device=device, dtype=torch.float32)
        top_p = torch.tensor([top_ps[i] for i in rows], device=device, dtype=torch.float32)
        probs = torch.softmax(logits[index].float() / temperature[:, None], dim=-1)
        if any(top_ps[i] < 1 for i in rows):  # at 1.0, float rounding in the cumsum could drop the tail
            probs = top_p_filter(probs, top_p)
        noise = torch.empty_like(probs)
        for row, i in enumerate(rows):
            noise[row].exponential_(generator=generators[i])
        tokens[index] = (probs / noise).argmax(dim=-1)
    return tokens.tolist()
