"""What a hook raises when the engine lacks the code it expects. A leaf module: the registry
(``hooks.py``) names the modules that carry hooks out, and those modules raise this, so neither
imports the other."""


class AnchorMissing(RuntimeError):
    """The engine does not have the code a hook expects (another engine version)."""
