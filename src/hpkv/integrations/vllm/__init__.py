"""vLLM V1: the `HpkvConnectorV1` KV connector and its plugin registration."""
