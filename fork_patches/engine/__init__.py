"""Engine plumbing: the hook registry and its source proofs, the plugin, the on-disk overlay, quirks, the engine lock, platform and KV policies."""
