"""The HPKV Server: one process per node and pool that owns the tiered store, its protocol
(`protocol`), the daemon (`daemon`), the client library (`client`) and auto-start (`autostart`)."""
