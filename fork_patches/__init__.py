"""The overlay: what we add to an installed vLLM, one folder per concern.

- ``quant/``: the QPN quantization method (registered config, checkpoint conventions, the linear
  and MoE methods, TP sharding);
- ``spec/``: speculative decoding (depth policy, K=auto, sampling, GDN state, greedy identity,
  named-token log-probabilities);
- ``api/``: fixes to what the OpenAI server returns (constrained output, cut tool calls);
- ``route_census/``: what the engine did, per rank (the census, its schema, attention routes);
- ``engine/``: the hook registry and its proofs against each engine's source, the plugin, the
  on-disk overlay, engine quirks, the lock of engine builds, the platform and KV policies.

``engine/hooks.py`` is the one place where hooks are declared; the modules it names carry them
out. tests/test_fork_patches_layout.py keeps every module in a folder and the imports free of
cycles (function-level imports and importlib strings counted).
"""
