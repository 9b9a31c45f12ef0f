"""The cluster tier: a memory tier every node shares, on Mooncake Store (docs/architecture.md,
docs/operations.md "Many nodes with a cluster tier"). `objects` (names and the verified object
format), `breaker` (the circuit breaker), `client` (Mooncake's client, bounded), `tier` (the tier
the store calls), `segment` (the process that contributes this node's memory)."""
