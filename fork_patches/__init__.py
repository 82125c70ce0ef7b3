"""The overlay: what we add to an installed vLLM (plugin, hooks, loader, dispatch, census)."""
