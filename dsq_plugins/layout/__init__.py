"""Where the numbers of one exchange sit: tensors fused into buckets, a
bucket's flat vector cut into chunks, and who serves which chunk."""
from ._buckets import DEFAULT_BUCKET_MB, Bucket, Pieces, Slot, plan_buckets, write_decoded
from ._owners import Ownership, chunk_bounds, combine, split

__all__ = ["DEFAULT_BUCKET_MB", "Bucket", "Ownership", "Pieces", "Slot", "chunk_bounds", "combine", "plan_buckets",
           "split", "write_decoded"]
