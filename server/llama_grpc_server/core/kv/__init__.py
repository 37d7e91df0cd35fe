"""The KV cache and its tiers: which slot a request takes and which prefix it reuses, the cells each
sequence holds, every KV edit of a tick, the events a router follows, and the disk tier."""
