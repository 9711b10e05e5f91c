"""Where the numbers of one exchange sit: tensors fused into buckets, a
bucket's flat vector cut into chunks, who serves which chunk, and which
ranks share a host."""
from ._buckets import DEFAULT_BUCKET_MB, Bucket, Pieces, Slot, plan_buckets, write_decoded
from ._hosts import HostLayout, choose_layout, launched_on_one_host, resolve_hosts
from ._owners import Ownership, chunk_bounds, combine, split

__all__ = ["DEFAULT_BUCKET_MB", "Bucket", "HostLayout", "Ownership", "Pieces", "Slot", "choose_layout",
           "chunk_bounds", "combine", "launched_on_one_host", "plan_buckets", "resolve_hosts", "split",
           "write_decoded"]
