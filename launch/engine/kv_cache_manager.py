"""Block allocator of the paged KV cache: which cache blocks each request owns.

The cache itself (one tensor per layer) lives with the model; this only hands out block ids,
after vLLM's PagedAttention block manager (Kwon et al., SOSP 2023).
"""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    """Hands out KV cache blocks of ``block_size`` token slots to requests.

    Raises:
        ValueError: if ``num_blocks`` or ``block_size`` < 1.
    """

    def __init__(self, *, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_blocks: deque[int] = deque(range(num_blocks))
        self._block_ids: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, request_id: int, num_tokens: int) -> bool:
        """Grow ``request_id``'s blocks to ``num_tokens`` tokens; False (nothing taken) if short."""
        owned = self._block_ids.setdefault(request_id, [])
        missing = self.num_blocks_for(num_tokens) - len(owned)
        if missing > len(self._free_blocks):
            if not owned:
                del self._block_ids[request_id]
            return False
        owned.extend(self._free_blocks.popleft() for _ in range(max(missing, 0)))
        return True

    def free(self, request_id: int) -> None:
        """Return all of ``request_id``'s blocks to the free list."""
        self._free_blocks.extend(self._block_ids.pop(request_id, ()))

    def block_ids(self, request_id: int) -> list[int]:
        return self._block_ids[request_id]

    def slot(self, request_id: int, position: int) -> int:
        """Flat cache slot (block_id * block_size + offset) of ``position`` in the request."""
        block_ids = self._block_ids[request_id]
        return block_ids[position // self.block_size] * self.block_size + position % self.block_size
