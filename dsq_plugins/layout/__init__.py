"""Where the numbers of one exchange sit: tensors fused into buckets, a
bucket's flat vector cut into chunks, who serves which chunk, and which
ranks share a host."""
from ._buckets import (DEFAULT_BUCKET_MB, Bucket, KeptBuffers, Layouts, Pieces, Slot, flat_input, input_problem,
                       length_problem, plan_buckets, write_decoded)
from ._hosts import HostLayout, choose_layout, launched_on_one_host, launcher_sizes, resolve_hosts
from ._owners import Ownership, chunk_bounds, combine, split

__all__ = ["DEFAULT_BUCKET_MB", "Bucket", "HostLayout", "KeptBuffers", "Layouts", "Ownership", "Pieces", "Slot",
           "choose_layout", "chunk_bounds", "combine", "flat_input", "input_problem", "launched_on_one_host",
           "launcher_sizes", "length_problem", "plan_buckets", "resolve_hosts", "split", "write_decoded"]
