"""Speculative decoding: depth policy, K=auto, sampled decoding, GDN state, greedy identity, named-token log-probabilities."""
