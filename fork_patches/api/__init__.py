"""What the OpenAI server returns: constrained output kept valid, tool calls kept across a cut."""
