"""The vocab-parallel embedding: each rank holds V/size rows, looks up the ids in its range (zeros for the others),
and the ranks sum. The matching lm_head is a `ColumnParallelLinear` over the vocab (same rows, so a tied embedding
shares the shard); its logits are gathered to rank 0 (`M3ForCausalLM.compute_logits`)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from m3serve.distributed.parallel import Parallel
from m3serve.model.sharding import Shard


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: Parallel, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.parallel = parallel
        self.start, self.stop = parallel.split(vocab_size, "vocab_size")
        self.shard = Shard(rows=(self.start, self.stop)) if parallel.size > 1 else Shard()
        self.weight = nn.Parameter(torch.zeros(self.stop - self.start, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.collective:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.start) & (ids < self.stop)
        y = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        return self.parallel.all_reduce(y.masked_fill_(~mine[:, None], 0))
