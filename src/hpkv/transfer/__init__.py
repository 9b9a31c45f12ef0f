"""Device <-> pool copies (torch). The only place in HPKV that knows about devices."""
