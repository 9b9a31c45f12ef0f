"""The HPKV Server: one process per node and pool that owns the tiered store, its protocol
(`protocol`), the daemon (`daemon`), the client library (`client`), auto-start (`autostart`) and
the Prometheus endpoint (`metrics`)."""
