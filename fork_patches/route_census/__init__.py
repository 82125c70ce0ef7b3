"""What the engine did, per rank: the route census, its schema, the attention routes it records."""
