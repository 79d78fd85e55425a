"""Hidden-state storage that follows the plan (docs/design/architecture.md §6).

One persistent device buffer holds, per request slot, a decode row (the state of the request's
newest token, or the state awaiting the coda) and a prefill ring of `ring_slots * chunk_size` rows.
Rows are addressed by flat indices so an invocation gathers and scatters all its rows at once.
"""

from __future__ import annotations

import torch


class HiddenStateStore:
    def __init__(
        self, max_num_seqs: int, ring_rows: int, hidden_size: int, dtype: torch.dtype, device
    ):
        self.max_num_seqs = max_num_seqs
        self.ring_rows = ring_rows
        # rows [0, max_num_seqs): decode rows; then one ring of `ring_rows` rows per slot
        self.buffer = torch.zeros(
            max_num_seqs * (1 + ring_rows), hidden_size, dtype=dtype, device=device
        )
        self._free = list(range(max_num_seqs - 1, -1, -1))

    def allocate(self, ring_rows: int) -> int:
        """A slot for a new request whose ring needs `ring_rows` rows."""
        if ring_rows > self.ring_rows:
            raise ValueError(
                f"a prefill ring of {ring_rows} rows exceeds the {self.ring_rows} sized"
            )
        if not self._free:
            raise RuntimeError("no free hidden-state slot: more running requests than max_num_seqs")
        return self._free.pop()

    def release(self, slot: int) -> None:
        self._free.append(slot)

    def decode_row(self, slot: int) -> int:
        return slot

    def ring_row(self, slot: int, offset: int) -> int:
        """Flat row of ring offset `offset` (slot * chunk_size + offset in chunk) of `slot`."""
        return self.max_num_seqs + slot * self.ring_rows + offset
