"""Descending order with lowest-id-first ties, without sorting the vocabulary.

The contract orders tokens by value and breaks ties by lowest id (a stable
descending sort). Sorting a [32, 152k] batch costs far more than torch.topk
of the few hundred leading entries (docs/backends/torch-measurements.md); but
topk picks arbitrarily among values tied at its cut. So both functions here
take values from topk and fall back to an exact pass over the row only where
a tie straddles the cut.
"""

from __future__ import annotations

import torch

# Candidate counts tried for top_p, smallest first; the last resort is the whole row.
TOP_P_CANDIDATES = (1024, 16384)


def avoid_host_reads(device: torch.device) -> bool:
    """Whether to pick sync-free forms over cheaper ones that read values back.

    On the CPU a read costs nothing, so the sampler looks at the data to skip
    work (few top_p candidates, noise only where it can win). On an
    accelerator each read stalls the stream until the GPU catches up; a
    full-row sort or noise over the whole row costs less than the stall.
    """
    return device.type != "cpu"


def first_n_mask(x: torch.Tensor, n: torch.Tensor, nth: torch.Tensor, ties_cut: bool) -> torch.Tensor:
    """[R, V] mask of each row's first n[r] entries in (value desc, id asc) order.

    ``nth`` [R, 1] is the n-th largest value. When no row's tie group at that
    value is cut by n, the mask is just ``x >= nth``; otherwise the tied
    entries are ranked by id.
    """
    if not ties_cut:
        return x >= nth
    above = x > nth
    tied = x == nth
    room = n[:, None] - above.sum(dim=-1, keepdim=True)
    return above | (tied & (tied.cumsum(dim=-1) <= room))


def _cuts_a_tie(values: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[R] whether sorted ``values`` continue the n-th value's tie group past position n."""
    width = values.shape[1]
    nth = values.gather(1, (n - 1)[:, None])
    after = values.gather(1, n.clamp(max=width - 1)[:, None])
    return (n < width) & (after == nth).squeeze(1)


def _first_n_of_sorted(x: torch.Tensor, n: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`first_n_mask` given each row's leading values, sorted descending."""
    return first_n_mask(x, n, values.gather(1, (n - 1)[:, None]), bool(_cuts_a_tie(values, n).any()))


def topk_lowest_id(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, ids) [R, k] of each row's k largest entries, descending, lowest id first on ties."""
    rows, width = x.shape
    values, ids = torch.topk(x, min(k + 1, width), dim=-1)  # one extra value shows a tie at the cut
    n = torch.full((rows,), k, dtype=torch.int64, device=x.device)
    if bool(_cuts_a_tie(values, n).any()):
        mask = first_n_mask(x, n, values[:, k - 1 : k], ties_cut=True)
        ids = torch.nonzero(mask)[:, 1].view(rows, k)
    else:
        ids = ids[:, :k]
    # Ascending ids first, so the stable sort by value puts the lowest id first among equals.
    ids = ids.sort(dim=-1).values
    values, order = torch.sort(x.gather(1, ids), dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor, first_try: int | None = None) -> torch.Tensor:
    """[R, V] the tokens top_p keeps: in (prob desc, id asc) order, each whose preceding mass is < top_p.

    The nucleus is found among the top few candidates (``first_try`` of them
    when the caller knows few tokens are left, e.g. after top_k); rows whose
    nucleus is larger retry with more, and finally with the whole row.
    """
    rows, width = probs.shape
    if avoid_host_reads(probs.device):  # one exact pass over the sorted row: nothing read back
        values = torch.sort(probs, dim=-1, descending=True).values
        n = ((values.cumsum(dim=-1) - values) < top_p[:, None]).sum(dim=-1).clamp(min=1)
        return first_n_mask(probs, n, values.gather(1, (n - 1)[:, None]), ties_cut=True)
    keep = None  # allocated once some row needs a second try
    todo = None  # rows still looking; None while that is every row
    tries = (*TOP_P_CANDIDATES, width) if first_try is None else (first_try, *TOP_P_CANDIDATES, width)
    for k in sorted({min(c, width) for c in tries}):
        sub = probs if todo is None else probs.index_select(0, todo)
        limit = (top_p if todo is None else top_p.index_select(0, todo))[:, None]
        values = torch.topk(sub, k, dim=-1).values
        preceding = values.cumsum(dim=-1) - values  # a prefix of the full sorted order's sums
        n = (preceding < limit).sum(dim=-1).clamp(min=1)  # the top token always stays
        done = (n < k) | (k == width)
        if bool(done.all()):
            mask = _first_n_of_sorted(sub, n, values)
            if todo is None:
                return mask
            keep[todo] = mask
            return keep
        if keep is None:
            keep = torch.empty(rows, width, dtype=torch.bool, device=probs.device)
        finished = torch.nonzero(done).flatten()
        if finished.numel():
            mask = _first_n_of_sorted(sub[finished], n[finished], values[finished])
            keep[finished if todo is None else todo[finished]] = mask
        todo = torch.nonzero(~done).flatten() if todo is None else todo[~done]
    raise AssertionError("unreachable: the last try covers the whole row")
