"""Micro-batches for the engine's forward and training passes: padded by count, or packed by tokens.

**By count** (``micro_batch`` sequences): each sequence is one row, right-padded. Right padding
needs no attention mask (causal attention never looks right) and positions are ``0 … S-1``.

**By token budget** (``max_tokens``, verl's dynamic batch size and Megatron's sequence packing):
sequences are packed into rows of at most ``max_tokens`` tokens, padding-free within a row; one
row is one micro-batch. Each packed sequence restarts its positions at 0 and attends only to
itself (:attr:`PackedBatch.segments`, per-segment causal attention in
:class:`emu.engine.model.Attention`), so it computes exactly what it computes alone. Rows are
right-padded to the longest row so that pipeline stages exchange one shape.

Either way, per response token ``t`` the model is read at row position ``start + prompt_len - 1 + t``
(``start`` = 0 when padded; :mod:`emu.engine.stage` conventions), and :meth:`PackedBatch.rows_of`
maps a row of results back to each sequence.
"""

from __future__ import annotations

from typing import Optional

import torch


def pack_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into bins of at most ``max_tokens`` tokens (first-fit decreasing).

    ``lengths[i]`` is sequence ``i``'s tokens. A sequence longer than ``max_tokens`` gets a bin of
    its own (the configuration layer refuses budgets below the longest sequence; the engine still
    runs it). Deterministic: ties keep input order. Returns bins in order of their first member,
    each listing indices in input order.

    Raises:
        ValueError: if ``max_tokens < 1``.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (-lengths[j], j)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


class PackedBatch:
    """The sequences of one call, laid out as ``n_micro`` micro-batches of ``mb`` rows.

    ``tokens [n·mb, S]`` and ``positions [n·mb, S]``; ``index [n·mb, T]`` row positions read per
    response token (0 where absent); ``targets [n·mb, T]`` the token at ``index + 1`` of the same
    sequence; ``per_token`` float ``[n·mb, T]`` tensors with ``mask`` (1 for real response tokens).
    ``segments`` is ``None`` when padded by count, else per row the token lengths packed into it
    (the row's padding tail, if any, last). ``place[i] = (row, offset)`` locates sequence ``i``'s
    read positions in ``index``. ``real_tokens`` counts tokens that are not padding.
    """

    def __init__(self, tokens, positions, index, targets, per_token, n_micro, mb, segments, place):
        self.tokens, self.positions, self.index, self.targets = tokens, positions, index, targets
        self.per_token, self.n_micro, self.mb = per_token, n_micro, mb
        self.segments: Optional[list[list[int]]] = segments
        self.place: list[tuple[int, int]] = place

    def micro(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        """Rows of micro-batch ``i`` of a ``[n·mb, …]`` tensor."""
        return tensor[i * self.mb:(i + 1) * self.mb]

    def head_width(self, i: int) -> int:
        """Read positions micro-batch ``i`` needs: its rows' most response tokens (at least 1).

        ``index``'s columns beyond it are padding in every row of the micro-batch, so the head
        reads ``index[:, :head_width(i)]`` only (the call's width ``T`` is its longest row's).
        """
        return max(1, int(self.micro(self.per_token["mask"], i).sum(1).max()))

    @property
    def real_tokens(self) -> int:
        return int((self.positions >= 0).sum())

    def rows_of(self, rows: torch.Tensor, lengths: list[int]) -> list[list[float]]:
        """Per sequence ``i``, its ``lengths[i]`` results from ``rows [n·mb, T]`` (see :attr:`place`)."""
        return [rows[r, off:off + n].tolist() for (r, off), n in zip(self.place, lengths)]

    @classmethod
    def build(cls, sequences: list[list[int]], index: list[list[int]], mb: int, device: torch.device,
              per_token: Optional[dict[str, list[list[float]]]] = None,
              max_tokens: Optional[int] = None) -> "PackedBatch":
        """Lay out ``sequences`` with read positions ``index`` (one list per sequence).

        ``mb`` sequences per micro-batch, or, when ``max_tokens`` is given, rows packed to at most
        that many tokens (:func:`pack_by_tokens`; ``mb`` is then ignored).

        Raises:
            ValueError: if a ``per_token`` entry does not match the sequences or response lengths.
        """
        for key, lists in (per_token or {}).items():
            if len(lists) != len(sequences):
                raise ValueError(f"per_token[{key!r}] has {len(lists)} rows for {len(sequences)} sequences")
            for i, (row, ix) in enumerate(zip(lists, index)):
                if len(row) != len(ix):
                    raise ValueError(f"per_token[{key!r}][{i}] has {len(row)} values for {len(ix)} response tokens")
        if max_tokens is None:
            groups = [[i] for i in range(len(sequences))]
            n_micro = -(-len(sequences) // mb)
            rows = n_micro * mb
        else:
            groups = pack_by_tokens([len(s) for s in sequences], max_tokens)
            n_micro, mb, rows = len(groups), 1, len(groups)
        seq = max(sum(len(sequences[i]) for i in g) for g in groups)
        width = max(1, max(sum(len(index[i]) for i in g) for g in groups))
        tokens = torch.zeros((rows, seq), dtype=torch.int64)
        positions = torch.full((rows, seq), -1, dtype=torch.int64)
        idx = torch.zeros((rows, width), dtype=torch.int64)
        mask = torch.zeros((rows, width))
        floats = {key: torch.zeros((rows, width)) for key in (per_token or {})}
        place: list[tuple[int, int]] = [(0, 0)] * len(sequences)
        segments = [] if max_tokens is not None else None
        for r, group in enumerate(groups):
            start = off = 0
            for i in group:
                s, ix = sequences[i], index[i]
                tokens[r, start:start + len(s)] = torch.tensor(s, dtype=torch.int64)
                positions[r, start:start + len(s)] = torch.arange(len(s))
                idx[r, off:off + len(ix)] = torch.tensor(ix, dtype=torch.int64) + start
                mask[r, off:off + len(ix)] = 1.0
                for key, t in floats.items():
                    t[r, off:off + len(ix)] = torch.tensor(per_token[key][i], dtype=torch.float32)
                place[i] = (r, off)
                start, off = start + len(s), off + len(ix)
            if segments is not None:
                segments.append([len(sequences[i]) for i in group] + ([seq - start] if start < seq else []))
        targets = tokens.gather(1, (idx + 1).clamp(max=seq - 1)) * mask.long()
        tensors = {"mask": mask, **floats}
        return cls(tokens.to(device), positions.to(device), idx.to(device), targets.to(device),
                   {k: v.to(device) for k, v in tensors.items()}, n_micro, mb, segments, place)
