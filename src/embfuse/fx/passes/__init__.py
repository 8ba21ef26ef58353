"""The graph passes, each on its own (torch.fx GraphModules in, the same GraphModules out):
lookups.py batches nn.EmbeddingBag calls into collection lookups, copies.py combines host-to-device
copies, horizontal.py fuses per-feature chains; the overlap pass (fx/overlap.py) splits sharded
collections' all-to-alls."""

from embfuse.fx.overlap import overlap_collectives, split_collectives
from embfuse.fx.passes.copies import combine_copies
from embfuse.fx.passes.horizontal import FusedChain, HorizontalFusion, fuse_horizontal
from embfuse.fx.passes.lookups import LookupBatch, batch_lookups
from embfuse.fx.views import RowView, TableView, restore_names

__all__ = ["FusedChain", "HorizontalFusion", "LookupBatch", "RowView", "TableView", "batch_lookups", "combine_copies",
           "fuse_horizontal", "restore_names", "overlap_collectives", "split_collectives"]
