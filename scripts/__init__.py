"""The Python behind the shell entry points in this folder, in three roles along the data path.

- ``install``: put a pinned engine and this overlay into a virtualenv (``bootstrap-sm70.sh``).
- ``launcher``: serve a checkpoint on that engine and prove the boot (``serve-qwen38-native.sh``,
  ``demo.sh``).
- ``checkpoints``: the small checkpoints the demonstration and the tests serve, and the float
  references they are checked against.

The shell scripts stay at this level because they are the documented commands.
"""
