"""The launcher: serve a checkpoint on an installed engine and prove the boot.

``serve`` (behind ``scripts/serve-qwen38-native.sh``) refuses unsafe settings before the engine
starts (``serve_preflight``), takes the engine's vLLM arguments and gate expectations from its
profile (``engine_profiles``: engine-specific serving settings, read only here), derives the CUDA
graph capture sizes (``capture_ladder``), caps requests (``request_limits``, a vLLM middleware),
starts and supervises the server process group (``launched``) and reads the route census and
``/metrics`` into the boot-gate table (``boot_gates``). ``demo`` (behind ``scripts/demo.sh``) runs
the whole path on a machine without V100s.
"""
