"""Install: the first step of the data path, before any checkpoint is read.

``bootstrap`` (behind ``scripts/bootstrap-sm70.sh``) creates the engine's virtualenv, installs the
engine wheel pinned and hashed in ``engines.lock.toml``, installs this package into it, applies the
overlay (``qpn.fork_patches.engine.overlay``) and checks or restores it. The lock is package data: the
overlay and ``qpn.fork_patches.engine.engine_lock`` read it from here, in a checkout and in the wheel.

Engine-specific serving settings are not here: ``engine_profiles`` (vLLM arguments, environment,
what each boot gate expects per engine) is read only by the launcher, so it lives in
``qpn.scripts.launcher``; on-disk engine quirks are hooks in ``qpn.fork_patches``.
"""
