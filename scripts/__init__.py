"""Python entry points behind the shell scripts in this folder."""
