"""Right-padded, micro-batched token batches for the engine's forward and training passes.

Right padding needs no attention mask (causal attention never looks right) and positions are
``0 … S-1``; per response token ``t`` the model is read at ``prompt_len - 1 + t``
(:mod:`emu.engine.stage` conventions).
"""

from __future__ import annotations

from typing import Optional

import torch


class PackedBatch:
    """Right-padded sequences of one call, split into ``n_micro`` micro-batches of ``mb`` rows.

    ``tokens [n·mb, S]``; ``index [n·mb, T]`` positions read per response token (0 where
    absent); ``targets [n·mb, T]`` the token at ``index + 1``; ``per_token`` float ``[n·mb, T]``
    tensors with ``mask`` (1 for real response tokens). Rows past the data are padding.
    """

    def __init__(self, tokens, index, targets, per_token, n_micro, mb):
        self.tokens, self.index, self.targets = tokens, index, targets
        self.per_token, self.n_micro, self.mb = per_token, n_micro, mb

    def micro(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        """Rows of micro-batch ``i`` of a ``[n·mb, …]`` tensor."""
        return tensor[i * self.mb:(i + 1) * self.mb]

    @classmethod
    def build(cls, sequences: list[list[int]], index: list[list[int]], mb: int, device: torch.device,
              per_token: Optional[dict[str, list[list[float]]]] = None) -> "PackedBatch":
        """Pack ``sequences`` with read positions ``index`` (one list per sequence).

        Raises:
            ValueError: if a ``per_token`` entry does not match the sequences or response lengths.
        """
        n_micro = -(-len(sequences) // mb)
        rows, seq = n_micro * mb, max(len(s) for s in sequences)
        width = max(1, max(len(ix) for ix in index))
        tokens = torch.zeros((rows, seq), dtype=torch.int64)
        idx = torch.zeros((rows, width), dtype=torch.int64)
        mask = torch.zeros((rows, width))
        for i, (s, ix) in enumerate(zip(sequences, index)):
            tokens[i, :len(s)] = torch.tensor(s, dtype=torch.int64)
            idx[i, :len(ix)] = torch.tensor(ix, dtype=torch.int64)
            mask[i, :len(ix)] = 1.0
        targets = tokens.gather(1, (idx + 1).clamp(max=seq - 1)) * mask.long()
        tensors = {"mask": mask}
        for key, lists in (per_token or {}).items():
            if len(lists) != len(sequences):
                raise ValueError(f"per_token[{key!r}] has {len(lists)} rows for {len(sequences)} sequences")
            t = torch.zeros((rows, width))
            for i, (row, ix) in enumerate(zip(lists, index)):
                if len(row) != len(ix):
                    raise ValueError(f"per_token[{key!r}][{i}] has {len(row)} values for {len(ix)} response tokens")
                t[i, :len(row)] = torch.tensor(row, dtype=torch.float32)
            tensors[key] = t
        return cls(tokens.to(device), idx.to(device), targets.to(device),
                   {k: v.to(device) for k, v in tensors.items()}, n_micro, mb)
