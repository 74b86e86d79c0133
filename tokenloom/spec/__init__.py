"""Speculative decoding: proposers (n-gram prompt lookup, a draft model, the target's own first layers)
and the verifier that accepts or rejects their draft tokens against the target in one forward pass."""
